// python/src/bind_data.cc: the data sources (data.h): whole samples from jsonl and Megatron
// files, lengths from any source, and the mock lengths and tokens.
#include <limits>
#include <memory>
#include <string>

#include "common.h"
#include "thdpack/blend.h"
#include "thdpack/data.h"

namespace thdpack::python {
namespace {

SourceOptions MakeOptions(int64_t vocab_size, uint64_t seed, bool shuffle) {
  SourceOptions o;
  o.vocab_size = vocab_size;
  o.seed = seed;
  o.shuffle = shuffle;
  return o;
}

int64_t Limit(const py::object& limit) {
  if (limit.is_none()) return std::numeric_limits<int64_t>::max();
  const int64_t n = Int64Of(limit, "limit");
  if (n < 0) throw py::value_error("limit = " + std::to_string(n) + ": must be >= 0 or None");
  return n;
}

// Up to `limit` samples of one epoch of `source`, as dicts {id, tokens, target_mask}.
py::list ReadSamples(SampleSource& source, int64_t limit) {
  std::vector<Sample> samples;
  Status status;
  {
    py::gil_scoped_release release;
    while (static_cast<int64_t>(samples.size()) < limit) {
      Result<std::optional<Sample>> r = source.Next();
      if (!r.ok()) {
        status = r.status();
        break;
      }
      if (!r->has_value()) break;
      samples.push_back(std::move(**r));
    }
  }
  ThrowIfError(status);
  py::list out;
  for (Sample& s : samples) {
    py::dict d;
    d["id"] = s.id;
    d["tokens"] = ToNumpy(std::move(s.tokens));
    d["target_mask"] = s.target_mask.empty() ? py::object(py::none())
                                             : py::object(ToNumpy(std::move(s.target_mask)));
    out.append(d);
  }
  return out;
}

}  // namespace

void BindData(py::module_& m) {
  m.def(
      "read_jsonl",
      [](const std::string& path, int64_t vocab_size, const py::object& limit) {
        auto source = ValueOrThrow(OpenJsonlSource(path, MakeOptions(vocab_size, 1234, false)));
        return ReadSamples(*source, Limit(limit));
      },
      py::arg("path"), py::kw_only(), py::arg("vocab_size") = 0, py::arg("limit") = py::none(),
      R"doc(Reads a JSON-lines file ("input_ids", optional "loss_mask") into a list of dicts
{id, tokens (int32), target_mask (uint8 or None)}, at most `limit` samples. ValueError/OSError
name the file, line and rule on bad input.)doc");

  m.def(
      "read_megatron",
      [](const std::string& prefix, int64_t vocab_size, const py::object& limit, bool shuffle,
         uint64_t seed) {
        auto source =
            ValueOrThrow(OpenMegatronSource(prefix, MakeOptions(vocab_size, seed, shuffle)));
        return ReadSamples(*source, Limit(limit));
      },
      py::arg("prefix"), py::kw_only(), py::arg("vocab_size") = 0, py::arg("limit") = py::none(),
      py::arg("shuffle") = false, py::arg("seed") = 1234,
      R"doc(Reads a Megatron-LM indexed dataset (PREFIX.idx + PREFIX.bin): one sample per
document, as read_jsonl returns them.)doc");

  m.def(
      "read_lengths",
      [](const std::string& spec, int64_t vocab_size, const py::object& limit, bool shuffle,
         uint64_t seed, int64_t mock_num_samples) {
        SourceOptions o = MakeOptions(vocab_size, seed, shuffle);
        o.mock_num_samples = mock_num_samples;
        auto source = ValueOrThrow(OpenSource(spec, o));
        if (source->endless() && limit.is_none()) {
          throw py::value_error("limit: " + spec + " never ends (a blend): give the number of "
                                "samples to read");
        }
        const int64_t n = Limit(limit);
        const bool blend = source->endless();
        std::vector<int64_t> ids, lengths, targets, sources, source_index, per;
        Status status;
        {
          py::gil_scoped_release release;
          while (static_cast<int64_t>(ids.size()) < n) {
            Result<std::optional<SampleLength>> r = source->NextLength();
            if (!r.ok()) {
              status = r.status();
              break;
            }
            if (!r->has_value()) break;
            ids.push_back((*r)->id);
            lengths.push_back((*r)->length);
            targets.push_back((*r)->n_targets);
            if (blend) {
              // The sample's position in its source's own order, counting across its epochs:
              // Megatron's dataset_sample_index.
              const size_t d = static_cast<size_t>((*r)->source);
              if (per.size() <= d) per.resize(d + 1, 0);
              sources.push_back((*r)->source);
              source_index.push_back(per[d]++);
            }
          }
        }
        ThrowIfError(status);
        py::dict d;
        d["ids"] = ToNumpy(std::move(ids));
        d["lengths"] = ToNumpy(std::move(lengths));
        d["n_targets"] = ToNumpy(std::move(targets));
        if (blend) {
          d["source"] = ToNumpy(std::move(sources));
          d["source_index"] = ToNumpy(std::move(source_index));
        }
        return d;
      },
      py::arg("spec"), py::kw_only(), py::arg("vocab_size") = 0, py::arg("limit") = py::none(),
      py::arg("shuffle") = false, py::arg("seed") = 1234, py::arg("mock_num_samples") = 0,
      R"doc(Reads (ids, lengths, n_targets) int64 arrays of one epoch of any source spec
("mock", "mock:FILE.json", "lengths:FILE", "histogram:FILE", "jsonl:FILE", "megatron:PREFIX",
"blend:FILE.json"), at most `limit` samples: what schedule() needs. A blend never ends (limit
is required) and adds `source` (each sample's index in its list of sources) and `source_index`
(the sample's position in its source's own order, across its epochs): Megatron's
dataset_index and dataset_sample_index.)doc");

  m.def(
      "blend_weights",
      [](const std::vector<double>& weights) {
        if (weights.empty()) throw py::value_error("weights: empty");
        return NormalizeWeights(weights);
      },
      py::arg("weights"),
      "The weights as a blend uses them: Megatron's normalize (w / numpy.sum(w) in float64, "
      "the sum in numpy's pairwise order).");

  m.def(
      "mock_lengths",
      [](int64_t n, int64_t min_seq_len, int64_t max_seq_len, double mean_seq_len, double sigma,
         uint64_t seed) {
        MockConfig c;
        c.mode = MockConfig::Mode::kDistribution;
        c.min_seq_len = min_seq_len;
        c.max_seq_len = max_seq_len;
        c.mean_seq_len = mean_seq_len;
        c.lognormal_sigma = sigma;
        if (n < 1) throw py::value_error("n = " + std::to_string(n) + ": must be >= 1");
        SourceOptions o = MakeOptions(0, seed, false);
        o.mock_num_samples = n;
        auto source = ValueOrThrow(OpenMockSource(c, o));  // validates the config
        std::vector<int64_t> lengths(static_cast<size_t>(n));
        {
          py::gil_scoped_release release;
          for (int64_t i = 0; i < n; ++i) lengths[static_cast<size_t>(i)] = MockLength(c, seed, i);
        }
        return ToNumpy(std::move(lengths));
      },
      py::arg("n"), py::kw_only(), py::arg("min_seq_len") = kDefaultMockConfig.min_seq_len,
      py::arg("max_seq_len") = kDefaultMockConfig.max_seq_len,
      py::arg("mean_seq_len") = kDefaultMockConfig.mean_seq_len,
      py::arg("sigma") = kDefaultMockConfig.lognormal_sigma, py::arg("seed") = 1234,
      R"doc(Lengths (int64 [n]) of samples 0..n-1 of the lognormal mock (Megatron's mock SFT
distribution): L = int(clip(exp(mu + sigma*z), min, max)), mu = ln(mean) - sigma^2/2.)doc");

  m.def(
      "mock_tokens",
      [](uint64_t seed, int64_t id, int64_t length, int64_t vocab) {
        if (length < 0) throw py::value_error("length = " + std::to_string(length) + ": must be >= 0");
        if (vocab < 1) throw py::value_error("vocab = " + std::to_string(vocab) + ": must be >= 1");
        return ToNumpy(MockTokens(seed, id, length, vocab));
      },
      py::arg("seed"), py::arg("id"), py::arg("length"), py::arg("vocab"),
      "The mock tokens of sample `id` (int32 [length] in [0, vocab)), the same on every rank.");
}

}  // namespace thdpack::python
