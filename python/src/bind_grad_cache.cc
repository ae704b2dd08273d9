// python/src/bind_grad_cache.cc: a cache of gradient buffers for thdpack.torch.local_loss on CPU.
//
// The gradient of a rank's logits is as large as the logits (1 GiB for bf16 [16384, 32000]),
// and a fresh buffer of that size is fresh pages: the kernel that writes it spends more time in
// the page faults that zero them than in its arithmetic (docs/python.md). A training loop asks
// for a buffer of about the same size every microbatch, and frees the last one before it asks
// again. So, as torch's CUDA caching allocator does for device memory, a freed buffer is kept
// and handed out again, its pages already mapped.
//
// A buffer goes back to the cache only when nothing holds it any more: it is handed out as a
// NumPy array whose base is a capsule, torch.from_numpy keeps that array alive for as long as
// the tensor's storage lives (autograd's references included), and the capsule's destructor
// returns the block. A block in use is never handed out twice.
//
// Policy (thdpack.torch.set_grad_cache, empty_grad_cache, grad_cache_info):
//   * a request takes the smallest free block that holds it, if that block is at most twice
//     the request (a small call never pins a huge block); else a new block is allocated;
//   * at most max_blocks free blocks are kept (default 1: a training loop has one loss call in
//     flight between microbatches); beyond that the block freed least recently goes back to
//     the system; 0 disables the cache (every buffer is freed on release).
// The cache holds its free blocks' memory between steps, as the CUDA caching allocator does:
// empty_grad_cache() gives it back.
#include <cstdlib>
#include <cstring>
#include <limits>
#include <list>
#include <mutex>
#include <string>

#include "common.h"

namespace thdpack::python {

namespace {

constexpr size_t kAlignment = 64;

struct Block {
  void* data = nullptr;
  size_t bytes = 0;
};

class GradCache {
 public:
  // A block of at least `bytes` (never null: throws MemoryError).
  Block Take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->bytes >= bytes && it->bytes / 2 <= bytes &&
            (best == free_.end() || it->bytes < best->bytes)) {
          best = it;
        }
      }
      if (best != free_.end()) {
        Block b = *best;
        free_.erase(best);
        ++hits_;
        in_use_bytes_ += b.bytes;
        return b;
      }
      ++misses_;
    }
    Block b;
    b.bytes = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    if (b.bytes == 0) b.bytes = kAlignment;
    b.data = std::aligned_alloc(kAlignment, b.bytes);
    if (b.data == nullptr) {
      PyErr_SetString(PyExc_MemoryError,
                      ("local_loss: cannot allocate a gradient buffer of " +
                       std::to_string(b.bytes) + " bytes")
                          .c_str());
      throw py::error_already_set();
    }
    std::lock_guard<std::mutex> lock(mu_);
    in_use_bytes_ += b.bytes;
    return b;
  }

  // Back from an array that nothing holds any more. Most recently freed first.
  void Give(Block b) {
    std::list<Block> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_bytes_ -= b.bytes;
      free_.push_front(b);
      Trim(&drop);
    }
    for (const Block& d : drop) std::free(d.data);
  }

  void SetMaxBlocks(int n) {
    std::list<Block> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      max_blocks_ = n;
      Trim(&drop);
    }
    for (const Block& d : drop) std::free(d.data);
  }

  py::dict Info() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t cached = 0;
    for (const Block& b : free_) cached += b.bytes;
    py::dict d;
    d["max_blocks"] = max_blocks_;
    d["cached_blocks"] = free_.size();
    d["cached_bytes"] = cached;
    d["in_use_bytes"] = in_use_bytes_;
    d["hits"] = hits_;
    d["misses"] = misses_;
    return d;
  }

 private:
  void Trim(std::list<Block>* drop) {
    while (static_cast<int>(free_.size()) > max_blocks_) {
      drop->push_back(free_.back());
      free_.pop_back();
    }
  }

  std::mutex mu_;
  std::list<Block> free_;  // most recently freed first
  int max_blocks_ = 1;
  size_t in_use_bytes_ = 0;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

// Never destroyed: a capsule may run its destructor during interpreter teardown.
GradCache& Cache() {
  static GradCache* cache = new GradCache();
  return *cache;
}

}  // namespace

void BindGradCache(py::module_& m) {
  m.def(
      "grad_buffer",
      [](int64_t rows, int64_t cols, const py::dtype& dtype) {
        if (rows < 0 || cols < 0) {
          throw py::value_error("grad_buffer: shape (" + std::to_string(rows) + ", " +
                                std::to_string(cols) + ") has a negative dimension");
        }
        if (dtype.attr("hasobject").cast<bool>()) {
          throw py::value_error("grad_buffer: dtype " + py::str(py::object(dtype)).cast<std::string>() +
                                " holds Python objects; expected a numeric dtype");
        }
        const size_t item = static_cast<size_t>(dtype.itemsize());
        size_t bytes = 0;
        if (__builtin_mul_overflow(static_cast<size_t>(rows), static_cast<size_t>(cols), &bytes) ||
            __builtin_mul_overflow(bytes, item, &bytes) ||
            bytes > static_cast<size_t>(std::numeric_limits<py::ssize_t>::max())) {
          PyErr_SetString(PyExc_MemoryError,
                          ("grad_buffer: shape (" + std::to_string(rows) + ", " +
                           std::to_string(cols) + ") of " + std::to_string(item) +
                           "-byte items does not fit in memory")
                              .c_str());
          throw py::error_already_set();
        }
        Block b = Cache().Take(bytes);
        auto* owned = new Block(b);
        py::capsule base(owned, [](void* p) {
          auto* blk = static_cast<Block*>(p);
          Cache().Give(*blk);
          delete blk;
        });
        return py::array(dtype, {rows, cols}, b.data, base);
      },
      py::arg("rows"), py::arg("cols"), py::arg("dtype"),
      R"doc(A C-contiguous, uninitialised [rows, cols] array of `dtype` from the gradient cache.

Its memory returns to the cache when nothing holds the array (or a torch tensor made from it
with torch.from_numpy) any more; a block in use is never handed out twice.)doc");
  m.def(
      "set_grad_cache",
      [](int max_blocks) {
        if (max_blocks < 0) {
          throw py::value_error("set_grad_cache: max_blocks = " + std::to_string(max_blocks) +
                                ": must be >= 0 (0 disables the cache)");
        }
        Cache().SetMaxBlocks(max_blocks);
      },
      py::arg("max_blocks"),
      "Keep at most max_blocks freed gradient buffers (default 1; 0 frees every buffer when "
      "released, and empties the cache).");
  m.def(
      "grad_cache_info", [] { return Cache().Info(); },
      "The gradient cache: max_blocks, cached_blocks, cached_bytes, in_use_bytes, hits, misses.");
}

}  // namespace thdpack::python
