#include <gtest/gtest.h>

#include "data/data_test_util.h"
#include "thdpack/data.h"
#include "thdpack/megatron_dataset.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::TempDir;
using testing_util::WriteText;

TEST(SourceFactoryTest, UnknownSpecsAndMissingPathsNameTheSpec) {
  for (const char* spec : {"", "avro:x", "mocks", "Mock", "hist:a.csv"}) {
    auto s = OpenSource(spec);
    ASSERT_FALSE(s.ok()) << spec;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(s.status().message(), std::string("unknown data source \"") + spec + "\""))
        << s.status().message();
    EXPECT_TRUE(Contains(s.status().message(), "megatron:PREFIX"));
  }
  for (const char* spec :
       {"jsonl:", "mock:", "megatron:", "lengths:", "histogram:", "parquet:", "arrow:"}) {
    auto s = OpenSource(spec);
    ASSERT_FALSE(s.ok()) << spec;
    EXPECT_TRUE(Contains(s.status().message(), "needs a path")) << s.status().message();
  }
}

TEST(SourceFactoryTest, OpensEveryKind) {
  TempDir dir;
  WriteText(dir.File("l.txt"), "4\n5\n");
  WriteText(dir.File("h.csv"), "length,count\n4,2\n");
  WriteText(dir.File("a.jsonl"), "{\"input_ids\":[1,2,3,4]}\n");
  WriteText(dir.File("m.json"), "{\"mode\":\"file\",\"path\":\"l.txt\"}");
  {
    auto w = MegatronWriter::Create(dir.File("ds"), MegatronDType::kInt32);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->AddDocument(std::vector<int64_t>{1, 2, 3, 4}).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  const std::string specs[] = {"mock", "mock:" + dir.File("m.json"), "lengths:" + dir.File("l.txt"),
                               "histogram:" + dir.File("h.csv"), "jsonl:" + dir.File("a.jsonl"),
                               "megatron:" + dir.File("ds")};
  for (const std::string& spec : specs) {
    auto s = OpenSource(spec);
    ASSERT_TRUE(s.ok()) << spec << ": " << s.status().ToString();
    EXPECT_EQ((*s)->spec(), spec);
    EXPECT_EQ((*s)->epoch(), 0);
    auto first = (*s)->Next();
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    ASSERT_TRUE(first->has_value());
    EXPECT_EQ((*first)->id, 0);
    if (spec != "mock") {
      EXPECT_EQ((*first)->tokens.size(), 4u) << spec;
    }
  }
  SourceOptions bad;
  bad.vocab_size = int64_t{1} << 40;
  for (const std::string& spec : specs) {
    auto s = OpenSource(spec, bad);
    ASSERT_FALSE(s.ok()) << spec;
    EXPECT_TRUE(Contains(s.status().message(), "vocab_size")) << s.status().message();
  }
}

}  // namespace
}  // namespace thdpack
