"""thdpack.torch._loss_torch: the loss with torch operations on chunks of tokens, on any
device and dtype: per chunk a float32 (float64) copy and its exponentials, the chunk's gradient
written into the one gradient buffer (two chunk-sized buffers of extra memory)."""
import torch

from ._loss_common import _accumulation_dtype, _chunk_rows


def _per_token_chunked(logits, labels, counted, want_grad, scale, chunk_tokens):
    """Torch operations on chunks of tokens (any device): (logprob, entropy) in the
    accumulation dtype [T], and the gradient scale * (softmax - onehot) on counted rows."""
    t, v = logits.shape
    acc = _accumulation_dtype(logits)
    dev = logits.device
    rows = _chunk_rows(logits, chunk_tokens)
    logprob = torch.zeros(t, dtype=acc, device=dev)
    entropy = torch.zeros(t, dtype=acc, device=dev)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) if want_grad else None
    lowest = torch.finfo(acc).min
    safe_labels = torch.where(counted, labels, torch.zeros_like(labels)).unsqueeze(-1)
    for s in range(0, t, rows):
        e = min(t, s + rows)
        x = logits[s:e].detach()
        c = counted[s:e]
        y = safe_labels[s:e]
        z = x.to(acc, copy=True)
        m = z.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows: not counted
        z.sub_(m).clamp_(min=lowest)  # -inf -> lowest: exp gives 0, and 0 * z stays 0
        p = torch.exp(z)
        ssum = p.sum(dim=-1)
        w = z.mul_(p).sum(dim=-1)  # sum exp(z - m) * (z - m)
        del z
        log_s = torch.log(ssum)
        lse = m.squeeze(-1) + log_s
        ent = log_s - w / ssum
        lp = x.gather(-1, y).squeeze(-1).to(acc) - lse
        bad = c & ~(torch.isfinite(lse) & torch.isfinite(ent))
        if bool(bad.any()):
            i = s + int(bad.nonzero()[0])
            raise ValueError(f"logits row {i} has a non-finite log-sum-exp: a counted token's "
                             "logits must be finite (and not all -inf)")
        zero = torch.zeros((), dtype=acc, device=dev)
        logprob[s:e] = torch.where(c, lp, zero)
        entropy[s:e] = torch.where(c, ent, zero)
        if want_grad:
            cf = c.to(acc)
            denom = torch.where(c, ssum, torch.ones_like(ssum))  # uncounted rows: 0, not 0/0
            p.mul_((cf * scale / denom).unsqueeze(-1))  # p * scale on counted rows, 0 elsewhere
            p.scatter_add_(-1, y, (-scale * cf).unsqueeze(-1))
            grad[s:e].copy_(p)
        del p
    return logprob, entropy, grad
