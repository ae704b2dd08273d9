#include "thdpack/status.h"

#include <gtest/gtest.h>

namespace thdpack {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument("x=" + std::to_string(x) + " is odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  THDPACK_ASSIGN_OR_RETURN(int h, Half(x));
  THDPACK_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(StatusTest, OkIsDefaultAndCheap) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(s.message().empty());
}

TEST(StatusTest, ErrorCarriesCodeAndMessage) {
  Status s = Status::Corruption("file.idx: byte 18: version 2 is not 1");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_EQ(s.ToString(), "Corruption: file.idx: byte 18: version 2 is not 1");
  EXPECT_EQ(s.WithContext("reading step 3").message(),
            "reading step 3: file.idx: byte 18: version 2 is not 1");
  EXPECT_TRUE(Status().WithContext("x").ok());
}

TEST(StatusTest, OriginIsTheCodeUnlessAPeerFailed) {
  EXPECT_EQ(Status().origin(), StatusCode::kOk);
  EXPECT_EQ(Status::Corruption("x").origin(), StatusCode::kCorruption);
  EXPECT_EQ(Status::Aborted("peer left").origin(), StatusCode::kAborted);
  Status a = Status::Aborted("rank 3 failed: InvalidArgument: bad", StatusCode::kInvalidArgument);
  EXPECT_EQ(a.code(), StatusCode::kAborted);
  EXPECT_EQ(a.origin(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.ToString(), "Aborted: rank 3 failed: InvalidArgument: bad");
  // Context keeps the origin.
  EXPECT_EQ(a.WithContext("step 2").origin(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.WithContext("step 2").code(), StatusCode::kAborted);
}

TEST(ResultTest, ValueAndErrorPropagate) {
  auto r = Quarter(12);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 3);
  auto e = Quarter(6);  // 6/2 = 3 is odd
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e.status().message(), "x=3 is odd");
}

TEST(ResultTest, OkStatusIsNotAValue) {
  Result<int> r{Status()};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace thdpack
