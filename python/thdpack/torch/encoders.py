"""Encoders on ranks of their own (non-colocated; docs/media.md "Encoders on their own ranks").

By default each item of a microbatch is encoded on one CP rank of the replica that trains it
(colocated). With ``encoder_ranks`` the vision tower runs on ranks of its own instead, as
Megatron's MIMO runs it: the language model's step runs over the other ranks (their
``Groups(world=...)``), and each step's items go to the encoder ranks, spread over them by the
encoder's cost, and their output rows come back to the language ranks whose shards hold their
tokens.

    ENC = [4, 5]                                     # world ranks; the others train the LM
    lm = dist.new_group([r for r in range(world) if r not in ENC])    # every rank calls these
    if rank in ENC:
        for step in tt.EncoderIterator(ENC, MEDIA):  # one per language-model step
            for mb in step:                          # one per microbatch, in the same order
                rows = [tt.route_media(tower(m["pixel_values"], m["grid_thw"]), mb, name)
                        for name, m in mb["media"].items()]
                sum(r.sum() for r in rows).backward()  # the language ranks' gradients arrive
    else:
        groups = tt.Groups(cp=..., dp=..., world=lm)
        for step in tt.PackedDataIterator(share, groups, media=MEDIA, encoder_ranks=ENC, ...):
            for mb in step:
                for name, m in mb["media"].items():  # pixel_values: none; grid_thw: none
                    rows = tt.route_media(embeds.new_zeros(0, H), mb, name)
                    embeds = embeds.index_put((m["token_index"],), rows)

What moves, per step, over the bridge group (default: the default group, which holds the
language ranks and the encoder ranks, nothing else):
  1. a header of every rank (its status, the step's microbatch count, its items);
  2. every item's grid and cost (the step's ``media_cost`` term) from every language rank;
     every rank then places each microbatch's items - of every replica and CP rank - over the E
     encoder ranks by the library's rule (``PlaceMediaItems``: longest processing time first),
     the same placement everywhere;
  3. one all-to-all of the payload bytes: each item's rows from the language rank that holds
     them (TP rank 0 of its CP position) to its encoder rank;
  4. per microbatch and modality, ``route_media``: each encoder rank's output rows to every TP
     rank of the CP position that staged the item, then, there, the CP all-to-all of the
     colocated path to the ranks whose shards hold the tokens. The backward is the reverse:
     each language rank's gradient rows to the encoder ranks (with SP every TP rank's, summed;
     without SP TP rank 0's, the others' being the same).
Every rank of the bridge group calls ``route_media`` for each declared modality of each
microbatch, in order, and runs the backward of each (the encoder ranks on the sum of their
``route_media`` results), in reverse order, as autograd does.

The step's failure reaches the encoder ranks: a language rank's error (agreed over the
language ranks by the step) is sent in the next header and raised on every encoder rank, named;
the end of the iterator (its steps, its data, ``close()``) ends the encoder ranks' iteration.
With PP the media reach the first stage alone: the bridge group is then ``encoder_group``, of
the first stage's ranks and the encoder ranks (the later stages take no part). Under the
dynamic scheduler a language rank in no CP group of a microbatch (``mb["idle"]``) still takes
part in that microbatch's bridge: its ``mb["media"]`` holds each modality with no items and no
tokens, and it calls ``route_media`` there too (``[0, H]`` in, ``[0, H]`` out, its result in
the loss as ``0 * rows.sum()``), since the bridge's all-to-all is over every rank of the bridge
group.
"""
import hashlib

import numpy as np
import torch
import torch.distributed as dist

from .. import _thdpack

_STEP, _STOP, _FAIL = 0, 1, 2
# The header of each rank: status, microbatches, item records, TP rank (-1: an encoder rank),
# SP (0/1), its staging rank (the bridge rank of TP rank 0 of its CP position), merge size.
_HEADER = 7
# An item record: microbatch, modality, t, h, w, cost (float64 bits), payload width, dtype code.
_RECORD = 8
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64)


def _dtype_code(dtype, where):
    try:
        return _DTYPES.index(dtype)
    except ValueError:
        raise TypeError(f"{where}: payload dtype {dtype} cannot cross to an encoder rank (one of "
                        f"{[str(d) for d in _DTYPES]})") from None


def _tokens(grids, merge):
    """Each item's placeholder tokens, t * (h / merge) * (w / merge) (media.h MediaGrid::tokens)
    of grid rows [k, 3] the step checked."""
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    return grids[:, 0] * (grids[:, 1] // merge) * (grids[:, 2] // merge)


def _check_encoder_ranks(encoder_ranks, group_ranks):
    """The encoder ranks as a list of distinct world ranks of the bridge group, or ValueError /
    TypeError naming the rule."""
    if isinstance(encoder_ranks, (str, bytes)) or not hasattr(encoder_ranks, "__iter__"):
        raise TypeError(f"encoder_ranks: expected a list of world ranks, got "
                        f"{type(encoder_ranks).__name__}")
    ranks = list(encoder_ranks)
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise TypeError(f"encoder_ranks: {r!r} is not a rank (an int)")
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise ValueError("encoder_ranks: empty (give at least one rank, or None to encode on "
                         "the CP ranks)")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"encoder_ranks: {ranks} names a rank twice")
    outside = [r for r in ranks if r not in group_ranks]
    if outside:
        raise ValueError(f"encoder_ranks: {outside} not in the bridge group's ranks "
                         f"{group_ranks}")
    if len(ranks) == len(group_ranks):
        raise ValueError(f"encoder_ranks: {ranks} is every rank of the bridge group; the "
                         f"language model needs the others")
    return ranks


class _Bridge:
    """One rank's side of the bridge: the group, who encodes, and the step's exchanges."""

    def __init__(self, group):
        """The bridge group alone (None: the default group); declare() says who encodes."""
        self.group = dist.group.WORLD if group is None else group
        self.group_ranks = list(dist.get_process_group_ranks(self.group))
        self.rank = dist.get_rank(self.group)
        self.size = len(self.group_ranks)
        self.names = self.encoder_ranks = None
        self.step = 0
        self.closed = False
        # The bridge's own tensors (headers, records, payload bytes) live where its group's
        # collectives take them: the current CUDA device under NCCL, the CPU otherwise.
        nccl = dist.get_backend(self.group) == "nccl"
        self.device = (torch.device("cuda", torch.cuda.current_device()) if nccl
                       else torch.device("cpu"))

    def declare(self, encoder_ranks, media, language_ranks=None, encoder=None):
        """The encoder ranks and the modalities, checked: ``language_ranks`` (global ranks)
        must be the bridge group's others; ``encoder`` True: this rank must be an encoder rank.
        TypeError/ValueError naming the rule."""
        self.names = list(media)
        self.encoder_ranks = _check_encoder_ranks(encoder_ranks, self.group_ranks)
        # Bridge-group positions of the encoder ranks, encoder index e = their order here.
        self.encoders = [self.group_ranks.index(r) for r in self.encoder_ranks]
        self.is_encoder = self.group_ranks[self.rank] in self.encoder_ranks
        if encoder and not self.is_encoder:
            raise ValueError(f"EncoderIterator: rank {self.group_ranks[self.rank]} is not one of "
                             f"the encoder ranks {self.encoder_ranks}")
        if language_ranks is not None:
            lm = sorted(int(r) for r in language_ranks)
            want = sorted(r for r in self.group_ranks if r not in self.encoder_ranks)
            if lm != want:
                raise ValueError(f"encoder_ranks: the language model's first stage holds ranks "
                                 f"{lm}; with encoder ranks {self.encoder_ranks} the bridge "
                                 f"group {self.group_ranks} leaves {want} to it (the bridge "
                                 f"group: the first stage's ranks and the encoder ranks)")

    def agree(self, error=None):
        """The bridge's first collective: every rank's view of the encoder ranks and its own
        check (``error``: this rank's exception, or None), so that a rank whose arguments are
        wrong fails every rank, named (this rank raising its own)."""
        from .groups import group_counter, set_group_counter
        key = hashlib.sha256(repr((self.encoder_ranks, self.names)).encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(key, "little", signed=True), error is not None,
                             group_counter()], dtype=torch.int64, device=self.device)
        every = [torch.zeros(3, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        every = torch.stack(every).cpu()
        # The language ranks made groups among themselves (groups.local_new_group): torch's
        # count of groups, which names the next one made by every rank, back in step.
        set_group_counter(int(every[:, 2].max()))
        failed = [r for r in range(self.size) if every[r, 1]]
        if failed:
            text = None if error is None else f"{type(error).__name__}: {error}"
            try:
                self._raise_from(failed, text, "making the bridge")
            except RuntimeError:
                if error is not None:
                    raise error from None
                raise
        if not bool((every[:, 0] == every[0, 0]).all()):
            raise ValueError(f"encoder_ranks: the ranks of the bridge group disagree on the "
                             f"encoder ranks or the modalities (this rank: "
                             f"{self.encoder_ranks}, {self.names})")

    def _raise_from(self, failed, error, what):
        msgs = [None] * self.size
        dist.all_gather_object(msgs, error, group=self.group)
        if error is not None:
            raise RuntimeError(error)
        first = failed[0]
        raise RuntimeError(f"{what}: rank {self.group_ranks[first]} of the bridge group failed: "
                           f"{msgs[first]}")

    # ---- the header ----

    def _headers(self, mine, error=None):
        every = [torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
                 for _ in range(self.size)]
        _named(f"step {self.step}'s header", self.group, lambda: dist.all_gather(
            every, torch.tensor(mine, dtype=torch.int64, device=self.device), group=self.group))
        h = torch.stack(every).cpu().numpy()
        failed = [r for r in range(self.size) if h[r, 0] == _FAIL]
        if failed:
            self._raise_from(failed, error, f"step {self.step}")
        return h

    def fail(self, error):
        """A language rank's failure, sent to every rank of the bridge (the encoder ranks raise
        it); raises it here. Collective over the language ranks' failure (each sends its own)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._headers([_FAIL, 0, 0, 0, 0, 0, 0], error)
        except RuntimeError:
            pass

    def stop(self):
        """The language ranks' end of the run: every encoder rank's iteration ends."""
        if self.closed:
            return
        self.closed = True
        h = self._headers([_STOP, 0, 0, 0, 0, 0, 0])
        lm = [r for r in range(self.size) if r not in self.encoders]
        if any(h[r, 0] != _STOP for r in lm):
            raise RuntimeError("encoder_ranks: the language ranks disagree on the end of the run")

    # ---- the step, on a language rank ----

    def send_step(self, step, tp_rank, sp, staging, merge):
        """A language rank's side of a step: its items' records, the payloads of TP rank 0 to
        the encoder ranks, and each microbatch's route_media tables (written into
        mb["media"][name]["route"]["bridge"]; pixel_values and grid_thw emptied). A check
        that fails here fails every rank of the bridge, named."""
        try:
            records, payload = self._records(step)
        except (TypeError, ValueError) as e:
            self.fail(f"{type(e).__name__}: {e}")
            raise
        mine = [_STEP, len(step.microbatches), len(records), tp_rank, int(sp), staging, merge]
        return self._exchange(mine, records, payload, step.microbatches)

    def _records(self, step):
        records, payload = [], []
        for i, mb in enumerate(step.microbatches):
            if mb.get("idle"):  # the dynamic scheduler: no group of this microbatch here
                continue
            for m, name in enumerate(self.names):
                part = mb["media"][name]
                pv = part["pixel_values"]
                grids = part["grid_thw"].cpu().numpy().reshape(-1, 3)
                if len(grids):
                    where = f"step {step.step}: '{name}'"
                    code = _dtype_code(pv.dtype, where)
                    width = int(pv.shape[1]) if pv.dim() == 2 else 1
                    cost = [_thdpack.media_item_cost([int(v) for v in g], *step.media_cost)
                            for g in grids]
                    at = 0
                    for g, c in zip(grids, cost):
                        rows = int(g[0] * g[1] * g[2])
                        records.append([i, m, g[0], g[1], g[2],
                                        np.float64(c).view(np.int64), width, code])
                        payload.append(pv[at:at + rows])
                        at += rows
        return records, payload

    # ---- the step, on an encoder rank ----

    def receive_step(self):
        """An encoder rank's side of a step: None at the run's end, else its microbatches."""
        if self.closed:
            return None
        mine = [_STEP, 0, 0, -1, 0, -1, 0]
        return self._exchange(mine, [], [], None)

    def _exchange(self, mine, records, payload, microbatches):
        h = self._headers(mine)
        lm = [r for r in range(self.size) if r not in self.encoders]
        status = {int(h[r, 0]) for r in lm}
        if status == {_STOP}:
            self.closed = True
            if microbatches is not None:
                raise RuntimeError("encoder_ranks: a language rank ended the run while this "
                                   "one made a step")
            return None
        if status != {_STEP}:
            raise RuntimeError(f"step {self.step}: the language ranks disagree (some ended the "
                               f"run, some made a step)")
        counts = {int(h[r, 1]) for r in lm}
        if len(counts) != 1:
            raise RuntimeError(f"step {self.step}: the language ranks have "
                               f"{sorted(counts)} microbatches")
        n_mb = counts.pop()
        merge = int(h[lm[0], 6])
        # Every rank's item records, padded to the longest.
        longest = max(1, int(h[:, 2].max()))
        buf = torch.zeros((longest, _RECORD), dtype=torch.int64)
        if records:
            buf[:len(records)] = torch.tensor(np.asarray(records, dtype=np.int64))
        every = [torch.zeros((longest, _RECORD), dtype=torch.int64, device=self.device)
                 for _ in range(self.size)]
        _named(f"step {self.step}'s items", self.group,
               lambda: dist.all_gather(every, buf.to(self.device), group=self.group))
        rec = [every[r][:int(h[r, 2])].cpu().numpy() for r in range(self.size)]
        staging = {r: int(h[r, 5]) for r in lm}
        stagers = [r for r in lm if int(h[r, 3]) == 0]
        for r in lm:
            s = staging[r]
            if s not in stagers or not np.array_equal(rec[r][:, :5], rec[s][:, :5]):
                raise RuntimeError(f"step {self.step}: bridge rank {r}'s items differ from "
                                   f"those of its TP rank 0 ({s})")
        # Each microbatch's items of every staging rank (bridge order, then their order) over
        # the encoder ranks: the library's placement, the same on every rank.
        E = len(self.encoders)
        enc_of = {r: np.zeros(len(rec[r]), dtype=np.int64) for r in stagers}
        for i in range(n_mb):
            keys = [(r, k) for r in stagers for k in np.nonzero(rec[r][:, 0] == i)[0]]
            if not keys:
                continue
            costs = np.array([rec[r][k, 5] for r, k in keys], dtype=np.int64).view(np.float64)
            place = _thdpack.place_media_items(costs, E)
            for (r, k), e in zip(keys, place):
                enc_of[r][k] = int(e)
        if microbatches is not None:
            out = self._language(h, rec, enc_of, staging, payload, microbatches, merge)
        else:
            out = self._encoder(h, rec, enc_of, stagers, lm, n_mb, merge)
        self.step += 1
        return out

    @staticmethod
    def _row_bytes(r):
        return int(r[6]) * torch.empty(0, dtype=_DTYPES[int(r[7])]).element_size()

    def _payload_exchange(self, send_parts, send_counts, recv_counts):
        send = (torch.cat([p.reshape(-1).to(self.device) for p in send_parts]) if send_parts
                else torch.zeros(0, dtype=torch.uint8, device=self.device))
        recv = torch.empty(sum(recv_counts), dtype=torch.uint8, device=self.device)
        _named(f"step {self.step}'s payloads", self.group, lambda: dist.all_to_all_single(
            recv, send, list(recv_counts), list(send_counts), group=self.group))
        return recv

    def _language(self, h, rec, enc_of, staging, payload, microbatches, merge):
        me = self.rank
        s = staging[me]
        mine = rec[me]
        place = enc_of[s]
        sp = bool(h[me, 4])
        tp0 = int(h[me, 3]) == 0
        # The payloads this rank stages (TP rank 0): each item's bytes to its encoder rank, by
        # destination, each destination's in record order.
        send_counts = [0] * self.size
        parts = []
        if tp0:
            for e, dest in enumerate(self.encoders):
                for k in np.nonzero(place == e)[0]:
                    rows = payload[k].contiguous()
                    b = rows.view(torch.uint8).reshape(-1) if rows.numel() else \
                        torch.zeros(0, dtype=torch.uint8)
                    parts.append(b)
                    send_counts[dest] += b.numel()
        self._payload_exchange(parts, send_counts, [0] * self.size)
        # route_media's tables of each microbatch and modality: the rows this rank's items'
        # outputs come back as (O, its items' tokens in item order), from each encoder rank in
        # record order; the colocated route then takes O as the encoder's output.
        for i, mb in enumerate(microbatches):
            if mb.get("idle"):  # no items, no tokens: the bridge's all-to-all alone
                mb["media"] = {name: self._idle_part() for name in self.names}
                continue
            for m, name in enumerate(self.names):
                ks = np.nonzero((mine[:, 0] == i) & (mine[:, 1] == m))[0]
                tokens = _tokens(mine[ks, 2:5], merge)
                first = np.concatenate([[0], np.cumsum(tokens)])
                recv_counts = [0] * self.size
                order = []
                for e, src in enumerate(self.encoders):
                    for j in np.nonzero(place[ks] == e)[0]:
                        order.append(np.arange(first[j], first[j + 1]))
                        recv_counts[src] += int(tokens[j])
                order = (np.concatenate(order) if order else np.zeros(0, dtype=np.int64))
                back = recv_counts if (tp0 or sp) else [0] * self.size
                part = mb["media"][name]
                pv = part["pixel_values"]
                part["pixel_values"] = pv.new_zeros((0,) + tuple(pv.shape[1:]))
                part["grid_thw"] = part["grid_thw"].new_zeros((0, 3))
                route = part["route"]
                route["bridge"] = {
                    "group": self.group, "out_rows": 0, "result_rows": int(first[-1]),
                    "send_index": torch.zeros(0, dtype=torch.int64), "send_counts": [0] * self.size,
                    "recv_counts": recv_counts, "recv_order": torch.from_numpy(order),
                    "back_send_counts": back, "back_recv_counts": [0] * self.size,
                    "back_recv_index": torch.zeros(0, dtype=torch.int64),
                }
                route["output_rows"] = 0
        return microbatches

    def _idle_part(self):
        """A modality of a microbatch in which this language rank is in no CP group (the
        dynamic scheduler): nothing to encode, no token to fill, and the bridge's tables with
        nothing to send or receive - route_media there takes [0, H] and returns [0, H]."""
        zeros = [0] * self.size
        empty = torch.zeros(0, dtype=torch.int64)
        return {"pixel_values": torch.zeros((0, 0)),
                "grid_thw": torch.zeros((0, 3), dtype=torch.int64), "token_index": empty,
                "route": {"output_rows": 0, "bridge": {
                    "group": self.group, "out_rows": 0, "result_rows": 0, "send_index": empty,
                    "send_counts": zeros, "recv_counts": zeros, "recv_order": empty,
                    "back_send_counts": zeros, "back_recv_counts": zeros,
                    "back_recv_index": empty}}}

    def _encoder(self, h, rec, enc_of, stagers, lm, n_mb, merge):
        e = self.encoders.index(self.rank)
        # The payloads this encoder rank receives: from each staging rank, in bridge order,
        # its items placed here, in record order.
        recv_counts = [0] * self.size
        got = []  # (staging rank, record index, payload bytes), in arrival order
        for r in stagers:
            for k in np.nonzero(enc_of[r] == e)[0]:
                x = rec[r][k]
                n = int(x[2] * x[3] * x[4]) * self._row_bytes(x)
                recv_counts[r] += n
                got.append((r, int(k), n))
        raw = self._payload_exchange([], [0] * self.size, recv_counts)
        at = 0
        rows_of = {}
        for r, k, n in got:
            x = rec[r][k]
            rows_of[(r, k)] = raw[at:at + n].view(_DTYPES[int(x[7])]).reshape(-1, int(x[6]))
            at += n
        got = [(r, k) for r, k, _ in got]
        out = []
        for i in range(n_mb):
            mb = {"microbatch": i, "media": {}}
            for m, name in enumerate(self.names):
                items = [(r, k) for r, k in got if rec[r][k, 0] == i and rec[r][k, 1] == m]
                grids = np.array([rec[r][k, 2:5] for r, k in items],
                                 dtype=np.int64).reshape(-1, 3)
                tokens = _tokens(grids, merge)
                first = np.concatenate([[0], np.cumsum(tokens)])
                where = {key: j for j, key in enumerate(items)}
                send_index, send_counts = [], [0] * self.size
                back_index, back_counts = [], [0] * self.size
                # Who takes an item's output rows: every TP rank of the CP position that staged
                # it (each language rank's staging rank, checked in _exchange), in its record
                # order; the gradient back from TP rank 0 without SP, from every TP rank with it.
                for q in lm:  # destinations in bridge order
                    r = int(h[q, 5])
                    ks = np.nonzero((rec[r][:, 0] == i) & (rec[r][:, 1] == m))[0]
                    for k in ks:
                        j = where.get((r, int(k)))
                        if j is None:
                            continue
                        idx = np.arange(first[j], first[j + 1])
                        send_index.append(idx)
                        send_counts[q] += len(idx)
                        if int(h[q, 3]) == 0 or bool(h[q, 4]):
                            back_index.append(idx)
                            back_counts[q] += len(idx)
                cat = (lambda a: torch.from_numpy(np.concatenate(a)) if a
                       else torch.zeros(0, dtype=torch.int64))
                if items:
                    pv = torch.cat([rows_of[key] for key in items])
                else:
                    pv = torch.zeros((0, 0), dtype=torch.float32)
                    for r in stagers:  # the modality's width and dtype, where a rank knows it
                        sel = rec[r][rec[r][:, 1] == m]
                        if len(sel):
                            pv = torch.zeros((0, int(sel[0, 6])), dtype=_DTYPES[int(sel[0, 7])])
                            break
                mb["media"][name] = {
                    "pixel_values": pv,
                    "grid_thw": torch.from_numpy(grids),
                    "token_index": torch.zeros(0, dtype=torch.int64),
                    "route": {
                        "output_rows": int(first[-1]),
                        "bridge": {
                            "group": self.group, "out_rows": int(first[-1]), "result_rows": 0,
                            "send_index": cat(send_index), "send_counts": send_counts,
                            "recv_counts": [0] * self.size,
                            "recv_order": torch.zeros(0, dtype=torch.int64),
                            "back_send_counts": [0] * self.size, "back_recv_counts": back_counts,
                            "back_recv_index": cat(back_index),
                        },
                    },
                }
            out.append(mb)
        return out


def _named(what, group, fn):
    """fn(), a collective over the bridge group; its failure (a peer gone: gloo's reset
    connection, NCCL's abort) raised naming the bridge and the step's part."""
    try:
        return fn()
    except RuntimeError as e:
        ranks = dist.get_process_group_ranks(group)
        raise RuntimeError(f"{what} over the encoder bridge (world ranks {ranks}) failed - a "
                           f"language or encoder rank left or failed: {e}") from e


class _BridgeRows(torch.autograd.Function):
    """The bridge's all-to-all of output rows (an encoder rank's rows to the language ranks that
    staged their items) and its reverse for the gradients."""

    @staticmethod
    def forward(ctx, out, anchor, b):
        ctx.b = b
        ctx.out_rows = out.shape[0]
        send = out.index_select(0, b["send_index"].to(out.device))
        recv = send.new_empty((sum(b["recv_counts"]),) + tuple(out.shape[1:]))
        _named("route_media", b["group"], lambda: dist.all_to_all_single(
            recv, send.contiguous(), list(b["recv_counts"]), list(b["send_counts"]),
            group=b["group"]))
        result = out.new_zeros((b["result_rows"],) + tuple(out.shape[1:]))
        return result.index_copy_(0, b["recv_order"].to(out.device), recv)

    @staticmethod
    def backward(ctx, grad):
        b = ctx.b
        order = b["recv_order"].to(grad.device)
        send = grad.index_select(0, order) if sum(b["back_send_counts"]) else \
            grad.new_zeros((0,) + tuple(grad.shape[1:]))
        recv = grad.new_empty((sum(b["back_recv_counts"]),) + tuple(grad.shape[1:]))
        _named("route_media's backward", b["group"], lambda: dist.all_to_all_single(
            recv, send.contiguous(), list(b["back_recv_counts"]), list(b["back_send_counts"]),
            group=b["group"]))
        g_out = grad.new_zeros((ctx.out_rows,) + tuple(grad.shape[1:]))
        g_out.index_add_(0, b["back_recv_index"].to(grad.device), recv)
        return g_out, None, None


def bridge_rows(out, bridge):
    """The bridge's leg of route_media (media.py): differentiable, collective over the bridge
    group (its backward too, hence the anchor: every rank takes part in its peers')."""
    anchor = torch.empty(0, device=out.device, requires_grad=torch.is_grad_enabled())
    return _BridgeRows.apply(out, anchor, bridge)


def make_bridge(encoder_ranks, media, group=None, language_ranks=None, error=None,
                encoder=None):
    """This rank's bridge, agreed over the bridge group (collective): ``error``, this rank's
    own failure before it (an exception), or one of the bridge's checks (_Bridge.declare)
    fails every rank, each naming it. Returns the _Bridge."""
    bridge = _Bridge(group)
    if error is None:
        try:
            bridge.declare(encoder_ranks, media, language_ranks, encoder)
        except (TypeError, ValueError) as e:
            error = e  # still agreed, so that every rank raises
    bridge.agree(error)
    return bridge


class EncoderIterator:
    """An encoder rank's steps (``encoder_ranks``; this module's docstring): one list of
    microbatches per step of the language ranks' PackedDataIterator, in the same order, each
    ``{"microbatch": i, "media": {name: {"pixel_values", "grid_thw", "token_index" (empty),
    "route"}}}`` for every declared modality (empty where this rank encodes none of it). Ends
    when the language ranks' iterator ends; a language rank's error is raised here, named.
    ``group``: the bridge group (default: the default group)."""

    def __init__(self, encoder_ranks, media, group=None):
        from .media import media_specs
        error = None
        try:
            media_specs(media)
        except (TypeError, ValueError) as e:
            error = e
        self._bridge = make_bridge(encoder_ranks, media, group, error=error, encoder=True)

    def __iter__(self):
        return self

    def __next__(self):
        mbs = self._bridge.receive_step()
        if mbs is None:
            raise StopIteration
        return mbs


def encoder_batch(encoder_ranks, media, group=None):
    """An encoder rank's side of one ``pack_batch(..., encoder_ranks=...)`` call: its
    microbatches (as EncoderIterator's steps)."""
    it = EncoderIterator(encoder_ranks, media, group)
    mbs = it._bridge.receive_step()
    if mbs is None:
        raise RuntimeError("encoder_batch: the language ranks ended instead of packing a batch")
    return mbs
