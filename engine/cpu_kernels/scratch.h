// Per-thread scratch that only grows: std::vector::resize zero-fills what it grows by, so a scratch sized down and
// up again call by call (products of different K, sequences of different lengths) was cleared every time.
#pragma once

#include <stddef.h>

#include <vector>

namespace spindle {

template <class T>
T* grow(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

}  // namespace spindle
