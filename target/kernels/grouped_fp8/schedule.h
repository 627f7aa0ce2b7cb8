// schedule.h: which output tiles the FP8 grouped GEMM (grouped_fp8.h) has and which CTA takes
// each. No CUDA or torch beyond the host/device qualifiers, so host tests check the mapping.
//
// The rows of x are sorted by group (a MoE layer's token-expert pairs in expert order): group g
// holds rows [ends[g - 1], ends[g]) (ends[-1] = 0), and multiplies them by its own W_g [n, k]. A
// group's rows are cut into m-tiles of kTileRows from its first row (the last one partial), the
// output columns into n-tiles of kTileCols; tiles are numbered m-tile-major over all groups
// (t = m_tile * n_tiles + n_tile), so that the CTAs of one wave share a tile's rows of x (read
// from L2) and stream different tiles of W (read once). The tile count depends on the group sizes,
// which only the device knows when the kernel is queued: each CTA counts the m-tiles of every
// group itself (m_tiles_before) and takes tiles blockIdx.x, + gridDim.x, ... while any remain.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dflash::grouped_fp8 {

inline constexpr int kTileRows = 128;  // rows of x per tile: two consumer warpgroups of 64
inline constexpr int kTileCols = 128;  // rows of W per tile: one 128-row block of its factors
inline constexpr int kBlockK = 128;    // columns per k-block: one 128-byte swizzled row of e4m3,
                                       // one 128-wide group of the factors

// The first row of group g (ends[-1] = 0).
DFLASHD_HOST_DEVICE inline int group_begin(const int32_t* ends, int g) { return g == 0 ? 0 : ends[g - 1]; }

DFLASHD_HOST_DEVICE inline int m_tiles_of(const int32_t* ends, int g) {
  return (ends[g] - group_begin(ends, g) + kTileRows - 1) / kTileRows;
}

// The n-tiles of an output of n columns (the last one partial when n is not a multiple of
// kTileCols).
DFLASHD_HOST_DEVICE inline int n_tiles_of(int64_t n) { return static_cast<int>((n + kTileCols - 1) / kTileCols); }

// One tile: rows [row_begin, row_end) of x (at most kTileRows, all of group `group`) by output
// columns [n_tile kTileCols, + kTileCols) (those below n).
struct Tile {
  int group = 0;
  int row_begin = 0, row_end = 0;
  int n_tile = 0;
};

// Tile t, given m_tiles_before[g] = the m-tiles of groups 0..g-1 for g = 0..groups (the last:
// every m-tile). A binary search over the groups; groups without rows own no m-tile and are never
// returned.
DFLASHD_HOST_DEVICE inline Tile locate(int64_t t, const int* m_tiles_before, const int32_t* ends, int groups,
                                       int n_tiles) {
  const int m_tile = static_cast<int>(t / n_tiles);
  int lo = 0, hi = groups;  // the last group g with m_tiles_before[g] <= m_tile
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (m_tiles_before[mid] <= m_tile) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  Tile tile;
  tile.group = lo;
  tile.row_begin = group_begin(ends, lo) + (m_tile - m_tiles_before[lo]) * kTileRows;
  tile.row_end = ends[lo] < tile.row_begin + kTileRows ? ends[lo] : tile.row_begin + kTileRows;
  tile.n_tile = static_cast<int>(t - static_cast<int64_t>(m_tile) * n_tiles);
  return tile;
}

}  // namespace dflash::grouped_fp8
