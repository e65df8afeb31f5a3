// The benchmarks' one median (src/common/median.h): the middle value of an odd count, the mean of
// the two middle values of an even one, whatever the input order; 0 for none.
#include "src/common/median.h"

#include <catch2/catch.hpp>

namespace terrace {
namespace {

TEST_CASE("Median: odd counts take the middle value, even counts the mean of the two middle ones") {
  CHECK(Median({}) == 0);
  CHECK(Median({7}) == 7);
  CHECK(Median({3, 1, 2}) == 2);
  CHECK(Median({10, 1}) == 5.5);            // not the larger (sorted[n / 2]) nor the smaller
  CHECK(Median({4, 1, 3, 2}) == 2.5);
  CHECK(Median({1, 100, 2, 3, 4, 5}) == 3.5);
}

TEST_CASE("MedianSpreadOf: the median with the smallest and largest value") {
  const MedianSpread s = MedianSpreadOf({5, 1, 9, 3});
  CHECK(s.median == 4);
  CHECK(s.min == 1);
  CHECK(s.max == 9);
  const MedianSpread none = MedianSpreadOf({});
  CHECK((none.median == 0 && none.min == 0 && none.max == 0));
}

}  // namespace
}  // namespace terrace
