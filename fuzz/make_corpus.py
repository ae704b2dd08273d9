#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (fuzz/corpus/<target>/), taken from the unit tests.

Usage: PYTHONPATH=build/python /usr/bin/python3 fuzz/make_corpus.py [OUT_DIR]   (default fuzz/corpus)

Each seed is one input a unit test uses (a valid one, or a corrupt one the test expects an error
for), so the fuzzers start from every shape the readers know. The wire seeds are encoded with the
thdpack module (encode_metadata); the golden message is the bytes of docs/wire_format.md. The
step's messages (step_message, position_frame, lengths_frame, groups_frame, size_frame) are the
golden bytes of src/wire/step_wire_test.cc and a larger step message encoded here from the
grammar (blend, sample fields, a blend's cursor), each after its control byte. Seeds
are kept small: the whole corpus is a few KB per target. Files are named by content.
"""
import hashlib
import os
import struct
import sys


def write(out, target, data):
    if isinstance(data, str):
        data = data.encode()
    folder = os.path.join(out, target)
    os.makedirs(folder, exist_ok=True)
    name = hashlib.sha1(data).hexdigest()[:16]
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def wire_seeds():
    import numpy as np
    import thdpack

    golden = bytes.fromhex("54 48 44 4D 01 1F 00 00 00  01 00 01 00 02 01 00 04 08 0C 50 06 01"
                           "02 01 22 01 0E  63 75 13 66")
    seeds = [golden]

    def mb(lengths, padded, n_valid):
        cu, cp = [0], [0]
        for l, p in zip(lengths, padded):
            cu.append(cu[-1] + l)
            cp.append(cp[-1] + p)
        return {"cu_seqlens": np.array(cu, dtype=np.int32),
                "cu_seqlens_padded": np.array(cp, dtype=np.int32), "n_valid": n_valid}

    # SmallExplicitStep of step_meta_test.cc: SP with a tail, explicit padding, huge ids.
    seeds.append(thdpack.encode_metadata(
        [mb([1, 9, 2], [4, 12, 8], 8), mb([5, 10], [12, 12], 0)],
        step=0xFFFFFFFFFFFFFFF0, epoch=1 << 40, dp_size=4, replica=3, cp_size=2, tp_size=3,
        sp=True, n_loss_tokens=1008, skipped_ids=[-3, 2**63 - 1, -2**63]))
    # No CP, one long sequence (large Rice parameter), a valid_deficit, no skipped ids.
    seeds.append(thdpack.encode_metadata([mb([70000], [70000], 123)], step=5, epoch=2))
    # Mode 1 (a tail on the last sequence), several microbatches of many short sequences.
    seeds.append(thdpack.encode_metadata(
        [mb([3, 1, 4, 1, 5, 9, 2, 6], [4, 4, 4, 4, 8, 12, 4, 16], 23), mb([7, 7], [8, 8], 12)],
        dp_size=2, replica=1, cp_size=2, n_loss_tokens=100, skipped_ids=[0, 1, 2]))
    # Version 2 (DynamicStep of step_meta_groups_test.cc): groups of 3, idle, 1 and 2 ranks.
    seeds.append(thdpack.encode_metadata(
        [mb([7, 1, 20], [12, 6, 24], 25), {"cu_seqlens": np.array([0], dtype=np.int32),
                                           "cu_seqlens_padded": np.array([0], dtype=np.int32),
                                           "n_valid": 0},
         mb([3, 5], [3, 5], 6), mb([9], [12], 6)],
        step=5, epoch=1, dp_size=2, replica=0, cp_size=2, n_loss_tokens=54, skipped_ids=[4, 2],
        groups=[(0, 3), (0, 0), (1, 1), (0, 2)], domain_rank=1))
    # Version 3: the golden message of docs/wire_format.md (rank multiple 16), and the version 2
    # step above with rank multiple 16 (the groups flag; each group's T a multiple of c * 16).
    seeds.append(bytes.fromhex("54 48 44 4D 03 22 00 00 00  01 00 01 00 02 01 00 04 10 08 20"
                               "A0 06 06 01 02 21 14 22 01 0E  87 25 24 05"))
    seeds.append(thdpack.encode_metadata(
        [mb([7, 1, 20], [12, 6, 30], 25), {"cu_seqlens": np.array([0], dtype=np.int32),
                                           "cu_seqlens_padded": np.array([0], dtype=np.int32),
                                           "n_valid": 0},
         mb([3, 5], [3, 13], 6), mb([9], [32], 6)],
        step=5, epoch=1, dp_size=2, replica=0, cp_size=2, n_loss_tokens=54, skipped_ids=[4, 2],
        groups=[(0, 3), (0, 0), (1, 1), (0, 2)], domain_rank=1, rank_multiple=16))
    return seeds


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def zigzag(v):
    return ((v << 1) ^ (v >> 63)) & (2**64 - 1)


def rice_stream(values, k):
    bits = []
    for v in values:
        bits += [0] * (v >> k) + [1] + [(v >> i) & 1 for i in range(k)]
    bits += [0] * (-len(bits) % 8)
    return bytes(sum(b << i for i, b in enumerate(bits[j:j + 8])) for j in range(0, len(bits), 8))


def cursor(ints, shape=0, rest=b""):
    # The seven integers of the table, each minus its row's minimum (epoch_size: -1).
    mins = [0, 0, 0, 0, 0, 0, -1]
    return bytes([shape]) + b"".join(varint(v - m) for v, m in zip(ints, mins)) + rest


def frame(body, kind):
    t = bytes(body) + bytes([kind, 4, 0, 0])
    return t + struct.pack("<I", crc32c(t))


def large_step_message():
    """A static step (DP 2, replica 1, CP 1) of two microbatches, a blend's cursor, sources and
    one 8-byte sample field (docs/wire_format.md, "Body, version 4")."""
    body = varint(9) + varint(0) + varint(2) + varint(1)  # step, epoch, dp_size, replica
    body += varint(1) + varint(1) + bytes([0]) + varint(1) + varint(1)  # cp, tp, flags, pm, R
    body += varint(17) + varint(17) + varint(87) + varint(31)  # real, padded, sum_sq, N
    body += varint(2)  # microbatches
    body += varint(3) + bytes([0x80 | 1]) + varint(2) + rice_stream([2, 6, 1], 1)
    body += varint(1) + bytes([1]) + rice_stream([4], 1)
    body += varint(0)  # no skipped ids
    parts = varint(2) + cursor([1, 3, 13, 0, 0, 0, 10]) + cursor([0, 27, 27, 1, 1234, 28, -1])
    taken = varint(2) + varint(13) + varint(27)
    body += varint(40) + bytes([1]) + cursor([0, 40, 40, 0, 0, 0, -1], 1, parts + taken)
    body += varint(30) + bytes([1]) + varint(1) + varint(8)  # n_loss_sequences, sources, F
    prev = 0
    for ids, deficits, sources in (([100, 98, 105], [0, 0, 1], [0, 1, 1]), ([101], [0], [0])):
        for i in ids:
            body += varint(zigzag(i - prev))
            prev = i
        body += b"".join(varint(d) for d in deficits) + b"".join(varint(x) for x in sources)
        body += bytes(range(8 * len(ids)))
    body += varint(5) + varint(1) + b"".join(struct.pack("<I", 0x01010101 * c) for c in range(10))
    msg = b"THDM" + bytes([4]) + struct.pack("<I", 9 + len(body) + 4) + body
    return msg + struct.pack("<I", crc32c(msg))


def step_wire_seeds():
    """(target, message) pairs: the golden bytes of src/wire/step_wire_test.cc and more."""
    golden = bytes.fromhex(
        "54 48 44 4D 04 3B 00 00 00 01 00 01 00 02 01 00 04 01 08 0C 50 06 01 02 01 22 01 0E"
        "03 00 02 00 00 14 04 00 00 04 01 01 02 03 04 05 06 07 08 09 0A 0B 0C 0D 0E 0F 10"
        "95 4F 13 BE")
    header = struct.pack("<8q", 2, 100, 3, 1, 0, 0, 0, 0)
    lengths = struct.pack("<6i", 0, 5, 4, 2, 3, 1)
    sourced = struct.pack("<4iII", 0, 9, 8, 3, 0xFFFFFFFF, 0x7FFFFFFF)  # source 3, group 2^63-1
    # With media: 4,096 patches, frame^2 2^24 (one 64 x 64 image), each as two words.
    media = struct.pack("<3i4I", 0, 5, 4, 4096, 0, 1 << 24, 0)
    return [
        ("step_message", golden),
        ("step_message", large_step_message()),
        ("position_frame", frame(bytes.fromhex("07 01 00 00 07 07 00 00 00 15"), 3)),
        ("position_frame", frame(bytes.fromhex("09 01 02 00 05 0B 02 00 00 00 05 01 03 01 02 00"
                                               "00 00 05 08 02 00 00 15"), 3)),
        ("position_frame", frame(varint(40) + bytes([1]) + cursor(
            [0, 40, 40, 0, 0, 0, -1], 1, varint(2) + cursor([1, 3, 13, 0, 0, 0, 10]) +
            cursor([0, 27, 27, 1, 1234, 28, -1]) + varint(2) + varint(13) + varint(27)), 3)),
        ("lengths_frame", frame(lengths, 2)),
        ("lengths_frame", frame(sourced, 2)),
        ("lengths_frame", frame(header, 1)),
        ("lengths_frame", frame(media, 2)),
        ("groups_frame", frame(bytes([2, 0, 2, 2, 2]), 6)),
        ("groups_frame", frame(varint(2) + varint(2) + b"cp" + varint(1) + b"2" + varint(6)
                               + b"fields" + varint(11) + b"a:float32[]", 7)),
        ("size_frame", frame(struct.pack("<q", 59), 5)),
        ("size_frame", frame(struct.pack("<2i", 5, 6), 4)),
    ]


def jsonl_seeds():
    return [
        '{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "text": "a \\"b\\"\\n"}',
        '{"meta": {"x": [1, {"y": null}], "z": -1.5e3}, "input_ids":[9]}\r',
        '{"input_ids":[0,31999],"loss_mask":[1,0]}',
        '{"input_ids": [1, 2}',
        '{"ids": [1]}',
        '{"input_ids": "1 2"}',
        '{"input_ids": []}',
        '{"input_ids": [1, 2.5]}',
        '{"input_ids": [1, true]}',
        '{"input_ids": [1, -3]}',
        '{"input_ids": [99999999999999999999]}',
        '{"input_ids": [2147483648]}',
        '{"input_ids": [1, 2], "loss_mask": [1, 2]}',
        '{"input_ids": [1, 2], "loss_mask": null}',
        '{"input_ids": [1], "x": 1e999}',
        '{"input_ids": [1]} x',
        '{"a":"\\u00e9\\ud83d\\ude00","input_ids":[10,20,30],"b":[true,false,null,{}]}',
    ]


def mock_seeds():
    return [
        '{"mode":"distribution","type":"lognormal","min_seq_len":16,"max_seq_len":16384,'
        '"mean_seq_len":2048,"lognormal_sigma":1.0}',
        '{"mode":"distribution","type":"lognormal","min_seq_len":1,"max_seq_len":2147483647,'
        '"mean_seq_len":1e300,"lognormal_sigma":40.0}',
        '{"mode":"distribution","type":"lognormal","min_seq_len":8.0,"max_seq_len":8,'
        '"mean_seq_len":0.001,"lognormal_sigma":0}',
        '{"mode":"file","path":"lengths.csv"}',
        '{"mode":"file","path":"/abs/lengths.txt"}',
        '{"mode":"distribution","type":"uniform"}',
        '{"mode":"distribution","type":"lognormal","min_seq_len":0,"max_seq_len":5,'
        '"mean_seq_len":3,"lognormal_sigma":1}',
        '[1, 2, 3]',
    ]


def lengths_seeds():
    return [
        "length\r\n12\r\n 7 \r\n1\n\n\n",
        "5\nabc\n",
        "5\n0\n",
        "-4\n",
        "3\n2147483648\n",
        "3\n\n4\n",
        "3\n4.5\n",
        "length\n",
        "1\n2\n3\n4096\n65536\n1000000000\n2147483647",
        "length,count\n3,2\n5,0\n8, 1\r\n",
        "3,4\n",
        "length,count\n3,4,5\n",
        "length,count\n5,4\n3,1\n",
        "length,count\n3,-1\n",
        "length,count\n2,4611686018427387904\n",
        "length,count\n1,9223372036854775807\n2,1\n",
        "length,count\n4,0\n",
        "length,count\n128,3\n256,5\n512,1\n1024,2\n",
    ]


def megatron_seed(dtype, sequences, documents, tokens_of=None, modes=False, controls=0):
    """controls byte, then .idx (MMIDIDX v1), then .bin with the tokens of every sequence."""
    size = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}[dtype]
    fmt = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}[dtype]
    idx = b"MMIDIDX\0\0" + struct.pack("<QBQQ", 1, dtype, len(sequences), len(documents))
    idx += b"".join(struct.pack("<i", len(s)) for s in sequences)
    pointer = 0
    for s in sequences:
        idx += struct.pack("<q", pointer)
        pointer += len(s) * size
    idx += b"".join(struct.pack("<q", d) for d in documents)
    if modes:
        idx += bytes(len(sequences))
    binary = b"".join(struct.pack("<" + fmt, t) for s in sequences for t in s)
    return bytes([controls | (8 if modes else 0)]) + idx + binary


def megatron_seeds():
    return [
        megatron_seed(8, [[1, 2, 3], [4, 5], [6]], [0, 1, 3]),
        megatron_seed(4, [[100000, 7], [999]], [0, 2], controls=4),
        megatron_seed(1, [[1], [2], [3], [4]], [0, 1, 2, 3, 4], controls=2),
        megatron_seed(5, [[-1, 5]], [0, 1]),
        megatron_seed(6, [[1.0, 2.5]], [0, 1]),
        megatron_seed(7, [[3.0, 4.0, 5.0]], [0, 1], modes=True),
        megatron_seed(3, [[1, 2], [], [3]], [0, 1, 2, 3]),  # an empty document
        megatron_seed(2, [[1, 2]], [0, 1], controls=1)[:-1],  # .bin one byte short, resized
    ]


def media_seeds():
    """(control, bytes) seeds of media_frame (fuzz/step_wire_checks.h CheckMediaFrame): a
    sample's media of two modalities (an image of 2x2 float32 rows of width 3, a timed video
    item without payload), and a rank's media frame of one microbatch with mRoPE."""
    q = lambda *v: struct.pack("<%dq" % len(v), *v)
    payload = bytes(range(48))  # 4 rows x 3 float32
    image = q(1, 0, 3, len(payload), 0) + q(1, 2, 2) + payload
    video = q(1, 1, 0, 0, 1) + q(2, 2, 2) + struct.pack("<d", 0.5)
    sample = image + video
    part = (q(1, 0, 3, len(payload), 1, 2, 1, 2) + q(1, 2, 2) + q(0, 3) + q(1, 0) + q(0)
            + q(1, 0) + q(1, 1) + payload)
    empty = q(0, 0, 0, 0, 0, 0, 0, 2) + q(0, 0) + q(0, 0)
    body = q(1) + q(2, 6) + q(0, 1, 2, 3, 4, 5) + part + empty
    return [(2 | (2 << 2), sample), (2 << 2, frame(body, 8)), (1 | (2 << 2), frame(body, 8))]


def arrow_seeds():
    """Seeds of arrow_columns (fuzz/arrow_columns_fuzz.cc): controls, batches, then per batch
    rows, offset, null flags and per column a length byte a row and the values."""
    def batch(rows, offset, nulls, columns):
        out = bytes([rows, offset, nulls])
        for lengths, values in columns:
            out += bytes(lengths) + bytes(values)
        return out
    ids = ([3, 2], [5, 6, 7, 8, 9])
    return [
        bytes([2, 0]) + batch(2, 0, 0, [ids]),                              # int32, no targets
        bytes([3 | 8 | 16, 1]) + batch(2, 1, 0, [([1, 3, 2], [4, 5, 6, 7, 8, 9]),
                                                 ([1, 3, 2], [1, 0, 1, 1, 1, 0])]) * 2,
        bytes([4 | 32, 0]) + batch(2, 0, 0, [ids, ([3, 2], [0, 1, 1, 1, 0])]),  # int8 mask
        bytes([3 | 48, 0]) + batch(2, 0, 0, [ids, ([3, 2], [0x9c, 6, 7, 0x9c, 9])]),  # labels
        bytes([2, 0]) + batch(2, 0, 1, [ids]),                              # a null row
        bytes([2 | 128 | 64, 0]) + batch(3, 0, 2, [([1, 1, 255], [1, 2, 3])]),  # offsets back
        bytes([2, 4]) + batch(2, 0, 0, [ids, ([3, 2], [1, 2, 3, 4, 5])]),   # a field 'adv'
        bytes([2, 4]) + batch(2, 0, 0, [ids, ([3, 1], [1, 2, 3, 4])]),      # its rows too short
    ]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus")
    for seed in wire_seeds():
        write(out, "wire_decode", seed)
        write(out, "wire_decode_sealed", seed)
    # The control byte of the step's targets (fuzz/step_wire_checks.h): bit 0 reseals; for
    # lengths_frame bit 1 picks the header and bits 2-4 the columns (source, group, media), for groups_frame bits 1-6
    # the domain (3: 4 ranks) or with bit 7 the job frame, for size_frame bits 1-3 the kind
    # opened (4: 5, a size).
    controls = {"lengths_frame": {0: 0, 1: 0, 2: 2}, "groups_frame": 6, "size_frame": 8}
    counts = {}
    for target, seed in step_wire_seeds():
        k = counts.get(target, 0)
        counts[target] = k + 1
        c = controls.get(target, 0)
        c = c.get(k, 0) if isinstance(c, dict) else c
        if target == "lengths_frame" and k == 1:
            c = 4 | 8  # source and group columns
        if target == "lengths_frame" and k == 3:
            c = 16  # the media column
        if target == "groups_frame" and k == 1:
            c = 128  # the job frame
        if target == "size_frame" and k == 1:
            c = 6  # opened as a samples frame
        write(out, target, bytes([c]) + seed)
        write(out, target, bytes([c | 1]) + seed)
    for control, seed in media_seeds():
        write(out, "media_frame", bytes([control]) + seed)
    for seed in jsonl_seeds():
        write(out, "jsonl_line", seed)
    for seed in mock_seeds():
        write(out, "mock_config", seed)
    for seed in lengths_seeds():
        write(out, "lengths_text", seed)
    for seed in megatron_seeds():
        write(out, "megatron_index", seed)
    for seed in arrow_seeds():
        write(out, "arrow_columns", seed)


if __name__ == "__main__":
    main()
