// src/data/arrow_test_util.h: an Arrow producer for the tests - record batches of list columns
// built from plain vectors and handed over through the Arrow C stream interface, each array
// owning its buffers and releasing them (and its children) as the specification says, so that
// thdpack's import is tested against the ownership rules a real producer follows.
#ifndef THDPACK_SRC_DATA_ARROW_TEST_UTIL_H_
#define THDPACK_SRC_DATA_ARROW_TEST_UTIL_H_

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "thdpack/arrow.h"

namespace thdpack::testing_util {

// One list column of a batch: row r is values[offsets[r] .. offsets[r + 1]) (offsets as given,
// so a test can break them); null_rows / null_values mark nulls (empty: none).
struct TestListColumn {
  std::string name;
  std::string value_format = "i";  // an Arrow format: c s i l C S I L b, or anything to refuse
  bool large = false;
  std::vector<int64_t> offsets;
  std::vector<int64_t> values;
  std::vector<bool> null_rows, null_values;
  int64_t list_offset = 0;  // the list array's own offset (a slice)
};

// One record batch: its rows, the struct array's offset (a slice: the columns hold `offset`
// rows before the batch's first) and its columns.
struct TestBatch {
  int64_t rows = 0;
  int64_t offset = 0;
  std::vector<TestListColumn> columns;
  std::vector<bool> null_rows;  // of the struct (rows + offset entries)
};

namespace arrow_test {

struct Holder {
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<const void*> pointers;
  std::vector<ArrowArray*> children;
};

inline void ReleaseArray(ArrowArray* a) {
  auto* h = static_cast<Holder*>(a->private_data);
  for (ArrowArray* c : h->children) {
    if (c->release != nullptr) c->release(c);
    delete c;
  }
  delete h;
  a->release = nullptr;
}

inline std::vector<uint8_t> Bits(const std::vector<bool>& set, size_t n) {
  std::vector<uint8_t> out((n + 7) / 8 + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    if (set[i]) out[i >> 3] |= static_cast<uint8_t>(1u << (i & 7));
  }
  return out;
}

// A validity bitmap (1 = valid) from a list of nulls; none when there is no null.
inline std::vector<uint8_t> Validity(const std::vector<bool>& nulls, size_t n, int64_t* count) {
  *count = 0;
  if (nulls.empty()) return {};
  std::vector<bool> valid(n, true);
  for (size_t i = 0; i < n && i < nulls.size(); ++i) {
    valid[i] = !nulls[i];
    *count += nulls[i];
  }
  return *count ? Bits(valid, n) : std::vector<uint8_t>{};
}

inline ArrowArray* NewArray(int64_t length, int64_t null_count, int64_t offset, Holder* h) {
  auto* a = new ArrowArray{};
  a->length = length;
  a->null_count = null_count;
  a->offset = offset;
  for (auto& b : h->buffers) h->pointers.push_back(b.empty() ? nullptr : b.data());
  a->n_buffers = static_cast<int64_t>(h->pointers.size());
  a->buffers = h->pointers.data();
  a->n_children = static_cast<int64_t>(h->children.size());
  a->children = h->children.data();
  a->release = ReleaseArray;
  a->private_data = h;
  return a;
}

inline ArrowArray* ValuesArray(const TestListColumn& c) {
  auto* h = new Holder;
  const size_t n = c.values.size();
  int64_t nulls = 0;
  h->buffers.push_back(Validity(c.null_values, n, &nulls));
  const std::string& f = c.value_format;
  const size_t width = f == "c" || f == "C" ? 1 : f == "s" || f == "S" ? 2
                       : f == "i" || f == "I" ? 4 : 8;
  std::vector<uint8_t> data;
  if (f == "b") {
    std::vector<bool> bits(n);
    for (size_t i = 0; i < n; ++i) bits[i] = c.values[i] != 0;
    data = Bits(bits, n);
  } else {
    data.resize(n * width + 1);
    for (size_t i = 0; i < n; ++i) std::memcpy(data.data() + i * width, &c.values[i], width);
  }
  h->buffers.push_back(std::move(data));
  return NewArray(static_cast<int64_t>(n), nulls, 0, h);
}

inline ArrowArray* ListArray(const TestListColumn& c, size_t entries) {
  auto* h = new Holder;
  int64_t nulls = 0;
  h->buffers.push_back(Validity(c.null_rows, entries, &nulls));
  std::vector<uint8_t> off(c.offsets.size() * (c.large ? 8 : 4));
  for (size_t i = 0; i < c.offsets.size(); ++i) {
    if (c.large) {
      std::memcpy(off.data() + i * 8, &c.offsets[i], 8);
    } else {
      const int32_t v = static_cast<int32_t>(c.offsets[i]);
      std::memcpy(off.data() + i * 4, &v, 4);
    }
  }
  h->buffers.push_back(std::move(off));
  h->children.push_back(ValuesArray(c));
  return NewArray(static_cast<int64_t>(c.offsets.size()) - 1 - c.list_offset, nulls,
                  c.list_offset, h);
}

inline void ReleaseSchema(ArrowSchema* s) {
  for (int64_t i = 0; i < s->n_children; ++i) {
    ArrowSchema* c = s->children[i];
    if (c->release != nullptr) c->release(c);
    delete c;
  }
  delete[] s->children;
  delete[] s->format;
  delete[] s->name;
  s->release = nullptr;
}

inline const char* Copy(const std::string& s) {
  char* out = new char[s.size() + 1];
  std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

inline void FillSchema(ArrowSchema* s, const std::string& format, const std::string& name,
                       std::vector<ArrowSchema*> children) {
  *s = ArrowSchema{};
  s->format = Copy(format);
  s->name = Copy(name);
  s->n_children = static_cast<int64_t>(children.size());
  s->children = new ArrowSchema*[children.size() + 1];
  for (size_t i = 0; i < children.size(); ++i) s->children[i] = children[i];
  s->flags = ARROW_FLAG_NULLABLE;
  s->release = ReleaseSchema;
}

struct StreamState {
  std::vector<TestBatch> batches;
  size_t next = 0;
  int64_t fail_at = -1;  // get_next of this batch fails (an IO error of the producer)
};

inline int GetSchema(ArrowArrayStream* s, ArrowSchema* out) {
  auto* st = static_cast<StreamState*>(s->private_data);
  const TestBatch& first = st->batches.at(0);
  std::vector<ArrowSchema*> cols;
  for (const TestListColumn& c : first.columns) {
    auto* value = new ArrowSchema;
    FillSchema(value, c.value_format, "item", {});
    auto* list = new ArrowSchema;
    FillSchema(list, c.large ? "+L" : "+l", c.name, {value});
    cols.push_back(list);
  }
  FillSchema(out, "+s", "", cols);
  return 0;
}

inline int GetNext(ArrowArrayStream* s, ArrowArray* out) {
  auto* st = static_cast<StreamState*>(s->private_data);
  if (static_cast<int64_t>(st->next) == st->fail_at) return EIO;
  if (st->next == st->batches.size()) {
    *out = ArrowArray{};  // the end: a released array
    return 0;
  }
  const TestBatch& b = st->batches[st->next++];
  auto* h = new Holder;
  int64_t nulls = 0;
  h->buffers.push_back(Validity(b.null_rows, static_cast<size_t>(b.rows + b.offset), &nulls));
  for (const TestListColumn& c : b.columns) {
    h->children.push_back(ListArray(c, static_cast<size_t>(b.rows + b.offset)));
  }
  ArrowArray* a = NewArray(b.rows, nulls, b.offset, h);
  *out = *a;  // moved: the struct's contents now belong to *out
  delete a;
  return 0;
}

inline const char* LastError(ArrowArrayStream*) { return "the producer's disk went away"; }

inline void ReleaseStream(ArrowArrayStream* s) {
  delete static_cast<StreamState*>(s->private_data);
  s->release = nullptr;
}

}  // namespace arrow_test

// A stream of `batches` (get_next of batch `fail_at` fails), owned by the returned struct until
// a consumer releases it.
inline ArrowArrayStream MakeTestStream(std::vector<TestBatch> batches, int64_t fail_at = -1) {
  ArrowArrayStream s{};
  s.get_schema = arrow_test::GetSchema;
  s.get_next = arrow_test::GetNext;
  s.get_last_error = arrow_test::LastError;
  s.release = arrow_test::ReleaseStream;
  s.private_data = new arrow_test::StreamState{std::move(batches), 0, fail_at};
  return s;
}

}  // namespace thdpack::testing_util

#endif  // THDPACK_SRC_DATA_ARROW_TEST_UTIL_H_
