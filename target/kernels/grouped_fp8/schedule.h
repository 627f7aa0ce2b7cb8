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

// The n-tiles of an output of n columns in tiles of `cols` (the last one partial when n is not a
// multiple).
DFLASHD_HOST_DEVICE inline int n_tiles_of(int64_t n, int cols = kTileCols) {
  return static_cast<int>((n + cols - 1) / cols);
}

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

// ---- one dense group (no ends) in clusters of two CTAs (grouped_fp8.cu's dense kernel) ----------
// A cluster takes a pair of m-tiles (rows [256 i, 256 i + 256)) by one n-tile of kDenseCols
// columns: CTA r of the cluster multiplies m-tile 2 i + r, and each CTA loads half of the tile's
// rows of W into both (TMA multicast), so that W's tile crosses L2 once for two m-tiles. Pairs are
// numbered with the m-pairs fastest (pair = n_tile * m_pairs + m_pair): the clusters of one wave
// read a few tiles of W (from memory, once) against all of x (from L2). The second m-tile of the
// last pair is empty when the m-tiles are odd; its CTA still loads its half of W for its peer.
inline constexpr int kDenseCols = 192;  // 1.5 of W's 128-row factor blocks: see dense_factors

struct DensePairs {
  int m = 0, m_pairs = 0, n_tiles = 0;
  DensePairs() = default;
  DFLASHD_HOST_DEVICE DensePairs(int64_t rows, int64_t n)
      : m(static_cast<int>(rows)),
        m_pairs(static_cast<int>((rows + 2 * kTileRows - 1) / (2 * kTileRows))),
        n_tiles(n_tiles_of(n, kDenseCols)) {}
  DFLASHD_HOST_DEVICE int64_t count() const { return static_cast<int64_t>(m_pairs) * n_tiles; }
  // The tile CTA `rank` (0 or 1) of the cluster multiplies for pair `pair`; rows past m are not
  // its own (row_end = row_begin when none is).
  DFLASHD_HOST_DEVICE Tile at(int64_t pair, int rank) const {
    Tile tile;
    tile.n_tile = static_cast<int>(pair / m_pairs);
    tile.row_begin = (2 * static_cast<int>(pair % m_pairs) + rank) * kTileRows;
    const int end = tile.row_begin + kTileRows;
    tile.row_end = end < m ? end : (m > tile.row_begin ? m : tile.row_begin);
    return tile;
  }
};

// ---- gate_up with SwiGLU and down_proj's quantisation (grouped_fp8.cu's SwiGLU kernel) ----------
// W is a SwiGLU's stacked gate_up [gate; up], `inner` rows each (a multiple of 128), and the
// product h = silu(x . gate^T) * (x . up^T) [m, inner] leaves quantised per 1x128 group of each
// row. A cluster of two CTAs takes an m-tile by one 128-wide block of h: one quantisation group
// of each row, and one factor block each of gate and up. CTA r computes h's columns [128 b + 64 r,
// + 64) from those 64 rows of gate and the same 64 of up (its tile's columns 0..63 and 64..127),
// both loaded into its own stage; x's 128 rows are loaded half by each CTA into both (TMA
// multicast). Numbered m-tiles fastest (index = h_block * m_tiles + m_tile), as DensePairs: the
// clusters of one wave read a few blocks of W (from memory, once) against all of x (from L2).
inline constexpr int kSwigluHalf = 64;  // h columns per CTA: gate and up rows of W each

struct SwigluTiles {
  int m = 0, m_tiles = 0, h_blocks = 0;
  SwigluTiles() = default;
  DFLASHD_HOST_DEVICE SwigluTiles(int64_t rows, int64_t inner)
      : m(static_cast<int>(rows)),
        m_tiles(static_cast<int>((rows + kTileRows - 1) / kTileRows)),
        h_blocks(static_cast<int>(inner / 128)) {}
  DFLASHD_HOST_DEVICE int64_t count() const { return static_cast<int64_t>(m_tiles) * h_blocks; }
  // Rows [row_begin, row_end) of x by h's block n_tile (both CTAs of the cluster take the same).
  DFLASHD_HOST_DEVICE Tile at(int64_t index) const {
    Tile tile;
    tile.n_tile = static_cast<int>(index / m_tiles);
    tile.row_begin = static_cast<int>(index % m_tiles) * kTileRows;
    const int end = tile.row_begin + kTileRows;
    tile.row_end = end < m ? end : m;
    return tile;
  }
};

// The first of h's columns (and of gate's rows of W) that CTA `rank` computes for `tile`; up's
// rows begin `inner` rows further.
DFLASHD_HOST_DEVICE inline int swiglu_column(const Tile& tile, int rank) {
  return tile.n_tile * 128 + rank * kSwigluHalf;
}

// W's factors for an n-tile of `cols` columns starting at column `first` of the output: the first
// 128-row block it reaches (first / 128), and how many of its 8-column chunks lie in that block
// (the rest lie in the next one; tiles of 128 or 192 columns start at a multiple of 64, so a tile
// spans at most two blocks).
struct TileBlocks {
  int first = 0;
  int chunks_in_first = 0;
};
DFLASHD_HOST_DEVICE inline TileBlocks tile_blocks(int64_t first, int cols) {
  const int into = static_cast<int>(first % 128), chunks = (128 - into) / 8;
  return {static_cast<int>(first / 128), chunks < cols / 8 ? chunks : cols / 8};
}

}  // namespace dflash::grouped_fp8
