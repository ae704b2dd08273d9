// Phase 4, exchange (design.md section 7, step 3): sends and receives the sample payloads, to
// the ranks that pack them, in one all-to-all-v (MoveSamples) - among the loaders, to the
// replica the plan chose (ExchangeTokens), or among the heads, to every head of the sample's
// group (the dynamic step, dynamic_step.cc). A sample's payload is its int32 tokens, its mask
// bytes when the mask is not all ones, and its field buffers; each block that carries a sample
// is a samples frame (thdpack/step_wire.h): the payloads padded to 4 bytes, then the frame's
// trailer with its CRC-32C, checked on arrival; a token that stays is not sent. Afterwards
// refs_ points at every sample this rank packs (its own, or in recv_buffer_). Depends on:
// step_read.cc (own_), step_lengths.cc (out.samples, loader_offset_), step_plan.cc
// (replica_of_).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/fields.h"
#include "thdpack/step_wire.h"

namespace thdpack {

namespace {

// A sample's payload in the exchange: int32 tokens, then one mask byte a token when the mask
// is not all ones (n_targets != L - 1; target_mask[0] is never used, so such a mask is
// equivalent to the empty one).
// Then the sample's field buffers (thdpack/fields.h) back to back, in schema order.
bool SendsMask(const SampleLength& s) { return s.n_targets != s.length - 1; }
int64_t PayloadBytes(const SampleLength& s, std::span<const FieldSpec> fields) {
  return s.length * static_cast<int64_t>(sizeof(TokenId)) + (SendsMask(s) ? s.length : 0) +
         FieldBytes(fields, s.length);
}

}  // namespace

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

// The token exchange of a step over `group`: the samples at the positions send_ps[e] (read by
// this rank: own_ holds positions my_begin, my_begin + 1, ...) go to member e, tokens first
// and then the masks that travel, in blocks padded to 4 bytes; those at recv_ps[e] come from
// member e. refs_ then points at every sample this rank packs: its own where keeps(position),
// the received ones in recv_buffer_.
Status StepRunner::Impl::MoveSamples(ProcessGroup& group, const std::vector<SampleLength>& samples,
                                     const std::vector<std::vector<int64_t>>& send_ps,
                                     const std::vector<std::vector<int64_t>>& recv_ps,
                                     int64_t my_begin, const std::function<bool(int64_t)>& keeps) {
  const size_t n = static_cast<size_t>(group.size());
  // A block: its payloads padded to 4 bytes, and a trailer when it carries any.
  auto block_bytes = [&](const std::vector<int64_t>& ps) {
    int64_t b = 0;
    for (int64_t p : ps) b += PayloadBytes(samples[static_cast<size_t>(p)], opts_.fields);
    return ps.empty() ? 0 : (b + 3) / 4 * 4 + static_cast<int64_t>(kFrameTrailerSize);
  };
  std::vector<int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  for (size_t e = 0; e < n; ++e) {
    sc[e] = block_bytes(send_ps[e]);
    rc[e] = block_bytes(recv_ps[e]);
  }
  for (size_t j = 1; j < n; ++j) {
    sd[j] = sd[j - 1] + sc[j - 1];
    rd[j] = rd[j - 1] + rc[j - 1];
  }
  // Every byte of a block is written below (its pad to 4 bytes zeroed, the trailer sealed), so
  // neither buffer is zeroed when sized.
  RawBytes send(static_cast<size_t>(sd[n - 1] + sc[n - 1]));
  for (size_t e = 0; e < n; ++e) {
    std::byte* dst = send.data() + sd[e];
    for (int64_t p : send_ps[e]) {
      const Sample& x = own_[static_cast<size_t>(p - my_begin)];
      std::memcpy(dst, x.tokens.data(), x.tokens.size() * sizeof(TokenId));
      dst += x.tokens.size() * sizeof(TokenId);
    }
    for (int64_t p : send_ps[e]) {
      if (!SendsMask(samples[static_cast<size_t>(p)])) continue;
      const Sample& x = own_[static_cast<size_t>(p - my_begin)];
      std::memcpy(dst, x.target_mask.data(), x.target_mask.size());
      dst += x.target_mask.size();
    }
    for (int64_t p : send_ps[e]) {
      for (const std::vector<std::byte>& f : own_[static_cast<size_t>(p - my_begin)].fields) {
        if (f.empty()) continue;
        std::memcpy(dst, f.data(), f.size());
        dst += f.size();
      }
    }
    if (sc[e] > 0) {
      std::byte* end = send.data() + sd[e] + sc[e] - kFrameTrailerSize;
      std::fill(dst, end, std::byte{0});
      SealFrame(FrameKind::kSamples,
                std::span<uint8_t>(reinterpret_cast<uint8_t*>(send.data() + sd[e]),
                                   static_cast<size_t>(sc[e])));
    }
  }
  recv_buffer_.resize(static_cast<size_t>(rd[n - 1] + rc[n - 1]));
  THDPACK_RETURN_IF_ERROR(group.AllToAllV(send, sc, sd, recv_buffer_, rc, rd));
  // Each block checked before anything reads it.
  for (size_t e = 0; e < n; ++e) {
    if (rc[e] == 0) continue;
    auto body = OpenFrame(std::span<const uint8_t>(
                              reinterpret_cast<const uint8_t*>(recv_buffer_.data() + rd[e]),
                              static_cast<size_t>(rc[e])),
                          FrameKind::kSamples);
    if (!body.ok()) {
      return body.status().WithContext(
          "step " + std::to_string(step_) + ": received from " +
          Sender(group, static_cast<int>(e), dynamic_ ? "head" : "loader"));
    }
  }

  // Where each sample this rank packs lives now.
  refs_.assign(samples.size(), SampleRef{});
  for (size_t k = 0; k < own_.size(); ++k) {
    if (!keeps(my_begin + static_cast<int64_t>(k))) continue;
    const Sample& x = own_[k];
    SampleRef& r = refs_[static_cast<size_t>(my_begin) + k];
    r = SampleRef{x.tokens.data(), x.target_mask.empty() ? nullptr : x.target_mask.data(),
                  static_cast<int64_t>(x.tokens.size())};
    r.own_fields = &x.fields;
  }
  for (size_t e = 0; e < n; ++e) {
    const std::byte* at = recv_buffer_.data() + rd[e];
    for (int64_t p : recv_ps[e]) {
      const int64_t L = samples[static_cast<size_t>(p)].length;
      refs_[static_cast<size_t>(p)] = SampleRef{reinterpret_cast<const TokenId*>(at), nullptr, L};
      at += L * static_cast<int64_t>(sizeof(TokenId));
    }
    for (int64_t p : recv_ps[e]) {
      const SampleLength& len = samples[static_cast<size_t>(p)];
      if (!SendsMask(len)) continue;
      refs_[static_cast<size_t>(p)].mask = reinterpret_cast<const uint8_t*>(at);
      at += len.length;
    }
    for (int64_t p : recv_ps[e]) {
      refs_[static_cast<size_t>(p)].fields = at;
      at += FieldBytes(opts_.fields, samples[static_cast<size_t>(p)].length);
    }
  }
  return Status::Ok();
}

std::vector<int64_t> StepRunner::Impl::LoaderBlock(int s, int e) const {
  std::vector<int64_t> ps;
  for (int64_t p = loader_offset_[static_cast<size_t>(s)];
       p < loader_offset_[static_cast<size_t>(s) + 1]; ++p) {
    if (replica_of_[static_cast<size_t>(p)] == e) ps.push_back(p);
  }
  return ps;
}

// The all-to-all-v of sample payloads among the loaders. The block from loader s to loader e
// holds, for the samples s read that the plan sends to e (scheduling order), first all their
// int32 tokens, then the masks of those that send one, padded to a multiple of 4 bytes so that
// every block, and so every token array, stays 4-byte aligned in the receive buffer.
Status StepRunner::Impl::ExchangeTokens(RankStep& out) {
  const int dp = topo_.dp_size();
  const int me = coord_.dp;
  const auto& samples = out.samples;
  const size_t udp = static_cast<size_t>(dp);
  std::vector<std::vector<int64_t>> send_ps(udp), recv_ps(udp);
  for (int e = 0; e < dp; ++e) {
    if (e == me) continue;
    send_ps[static_cast<size_t>(e)] = LoaderBlock(me, e);
    recv_ps[static_cast<size_t>(e)] = LoaderBlock(e, me);
  }
  const int64_t my_begin = loader_offset_[static_cast<size_t>(me)];
  return MoveSamples(*loaders_, samples, send_ps, recv_ps, my_begin,
                     [&](int64_t p) { return replica_of_[static_cast<size_t>(p)] == me; });
}

}  // namespace thdpack
