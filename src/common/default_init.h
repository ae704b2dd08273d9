// A vector of bytes whose resize leaves new bytes uninitialised: for buffers that a collective or
// a copy fills whole right after they are sized (an exchange's send and receive buffers).
// std::vector<std::byte> zero-fills on resize, and on a fresh multi-megabyte buffer that fill
// (page faults and a memset) cost as much as the exchange's transfer itself.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace thdpack {

// std::allocator<T>, except that value-initialisation (resize(n), vector(n)) is
// default-initialisation: trivial types are left uninitialised.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  using std::allocator<T>::allocator;
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    std::construct_at(p, std::forward<Args>(args)...);
  }
};

// Bytes that resize() does not zero.
using RawBytes = std::vector<std::byte, DefaultInitAllocator<std::byte>>;

}  // namespace thdpack
