"""The padding a rank multiple costs (docs/layout.md, "Rank multiple"): the pad fraction of
`thdpack plan` on real length data when every rank's tokens of a microbatch must be a multiple
of R (R = 16, 32, 128: per-tensor FP8, MXFP8, FP8 block scaling), reached two ways:

  --align A          every sequence padded to a multiple of 2*CP*A (the only lever before
                     --rank-multiple). A is the smallest extra alignment that gives every rank
                     a multiple of R tokens whatever the sequences: the sequence alignment
                     z*A = lcm(z, s*R), z = 2*CP (1 without CP), s = CP (CP*TP with SP);
  --rank-multiple R  only T: the last sequence of each microbatch takes the tail.

For each topology row (CP = 1, 2, 4, 8; with SP at TP = 2, 4) it plans the first 20 steps of
the shuffled data (--shuffle, seed 1234: a histogram is read in length order otherwise) on
DP = 8 with the balanced scheduler and the llama2-7b cost, and prints the pad fraction
(padding / padded tokens) without either, then with each. Data sets: the WLB-LLM document
lengths, 512 documents a step (about 2M tokens), microbatches of 128K tokens (max tokens per
rank 131072 / CP, so every document fits at every CP); the SQuAD 1.1 histogram (short SFT
samples), 1024 samples a step (about 176K tokens), microbatches of 16K tokens (16384 / CP).

A table of figures, not a test: it checks nothing but that every plan succeeds.

Usage: PYTHONPATH=BUILD/python /usr/bin/python3 bench/rank_multiple_pad.py [DATA_DIR]
(DATA_DIR defaults to $THDPACK_DATA_DIR, else the repository's data/.)
"""
import math
import os
import sys

import thdpack

DP = 8
RANK_MULTIPLES = (16, 32, 128)
# (CP, TP, SP)
TOPOLOGIES = ([(cp, 1, False) for cp in (1, 2, 4, 8)] +
              [(cp, tp, True) for tp in (2, 4) for cp in (1, 2, 4, 8)])
STEPS = 20
# (title, source, samples a step, tokens a microbatch)
DATA = [("WLB-LLM document lengths, 512 documents a step, 128K-token microbatches",
         "lengths:{}/wlbllm_doc_lengths.txt", 512, 131072),
        ("SQuAD 1.1 histogram, 1024 samples a step, 16K-token microbatches",
         "histogram:{}/squad_384_histogram.csv", 1024, 16384)]


def data_dir():
    if len(sys.argv) > 1:
        return sys.argv[1]
    here = os.path.dirname(os.path.abspath(__file__))
    return os.environ.get("THDPACK_DATA_DIR", os.path.join(here, "..", "data"))


def align_for(cp, tp, sp, r):
    """The smallest --align that makes every rank's tokens a multiple of r for any lengths."""
    z = 2 * cp if cp > 1 else 1
    s = cp * tp if sp else cp
    return math.lcm(z, s * r) // z


def pad_fraction(data, global_batch, microbatch_tokens, cp, tp, sp, **layout):
    report = thdpack.plan_job(data=data, dp=DP, cp=cp, tp=tp, sp=sp,
                              max_tokens_per_rank=microbatch_tokens // cp,
                              global_batch=global_batch, steps=STEPS, shuffle=True,
                              summary_only=True, **layout)
    return report["summary"]["pad_fraction"]


def main():
    folder = data_dir()
    for title, spec, global_batch, microbatch_tokens in DATA:
        data = spec.format(folder)
        shape = (data, global_batch, microbatch_tokens)
        print(f"### {title}\n")
        head = "| CP | TP, SP | none |"
        rule = "|---|---|---|"
        for r in RANK_MULTIPLES:
            head += f" --align (R={r}) | --rank-multiple {r} |"
            rule += "---|---|"
        print(head)
        print(rule)
        for cp, tp, sp in TOPOLOGIES:
            row = f"| {cp} | {f'{tp}, SP' if sp else '-'} | "
            row += f"{100 * pad_fraction(*shape, cp, tp, sp):.2f}% |"
            for r in RANK_MULTIPLES:
                a = align_for(cp, tp, sp, r)
                by_align = pad_fraction(*shape, cp, tp, sp, align=a)
                by_rank = pad_fraction(*shape, cp, tp, sp, rank_multiple=r)
                row += f" {100 * by_align:.2f}% (A={a}) | {100 * by_rank:.2f}% |"
            print(row, flush=True)
        print()


if __name__ == "__main__":
    main()
