"""verl's own log-prob and entropy functions, loaded from its wheel for the tests that compare
thdpack against them (test_logprobs_verl.py).

scripts/make_venv.sh keeps verl's wheel (pure Python, no dependencies installed) in the
environment's wheels folder; the modules are executed from the wheel's own source with the
package imports verl makes at module level and these functions never use stubbed (its device
helpers, tensordict, transformers' tokenizer type) - the functions' code is verl's, unchanged.
Megatron's vocab-parallel cross-entropy, which verl's vocab-parallel log-probs call, is
megatron-core's own (installed in the environment).
"""
import importlib.util
import os
import sys
import types
import zipfile

VERL_VERSION = "0.6.1"


def wheel_path():
    """The verl wheel of the environment ($THDPACK_WHEELS, which the current stack's test
    sets, or the interpreter's environment's wheels; else the benchmarks' cache), or None."""
    name = f"verl-{VERL_VERSION}-py3-none-any.whl"
    for folder in (os.environ.get("THDPACK_WHEELS", ""), os.path.join(sys.prefix, "wheels"),
                   os.path.expanduser("~/.cache/thdpack-bench")):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    return None


def _stub(name, **attrs):
    m = types.ModuleType(name)
    m.__path__ = []
    m.__dict__.update(attrs)
    return m


def load(*names):
    """verl.utils.<name> modules (e.g. "torch_functional", "megatron.tensor_parallel") from the
    wheel; None when it is missing."""
    path = wheel_path()
    if path is None:
        return None
    import torch
    stubs = {
        "verl": _stub("verl"),
        "verl.utils": _stub("verl.utils"),
        "verl.utils.megatron": _stub("verl.utils.megatron"),
        "verl.utils.device": _stub("verl.utils.device", get_device_name=lambda: "cpu",
                                   get_torch_device=lambda: torch.cuda),
        "tensordict": _stub("tensordict", TensorDict=dict),
    }
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    out = []
    try:
        with zipfile.ZipFile(path) as z:
            for name in names:
                file = "verl/utils/" + name.replace(".", "/") + ".py"
                spec = importlib.util.spec_from_loader("verl.utils." + name, loader=None)
                m = importlib.util.module_from_spec(spec)
                exec(compile(z.read(file).decode(), file, "exec"), m.__dict__)
                out.append(m)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return out
