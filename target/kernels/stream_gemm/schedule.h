// schedule.h: how the stream-K GEMM (stream_gemm.h) shares a product's work among its CTAs. No
// CUDA or torch here beyond the host/device qualifiers, so host tests check the partition.
//
// The product y [m, n] = x [m, k] . W^T is cut into tiles of kRowsPerTile rows of W (all of x's
// rows at once), each tile into k-blocks of kBlockK columns. A unit is one (tile, k-block); units
// are numbered tile-major, and CTA c of `ctas` takes units [begin(c), begin(c + 1)), which differ
// in length by at most one: every SM streams the same number of weight bytes, whatever the number
// of tiles (a fixed split-k leaves a partial last wave).
//
// A CTA's range crosses tiles. Its stretch inside one tile is a Segment:
//   whole   the tile's k-blocks all in this CTA: it stores the tile's output;
//   part    starts after the tile's first k-block (only a CTA's first segment can): the CTA
//           writes its fp32 sums to its slot of the workspace and raises its flag;
//   head    starts at the tile's first k-block and ends before its last (only a CTA's last
//           segment can): the CTA waits for the flags of the CTAs after it that hold the rest of
//           the tile (followers), adds their sums and stores the output.
// A head waits only on CTAs whose part is their first segment, written before they wait on
// anything, so no CTA waits on one that waits on it.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dflash::stream_gemm {

inline constexpr int kRowsPerTile = 128;  // rows of W per tile: two consumer warpgroups of 64
inline constexpr int kBlockK = 64;        // columns per k-block: one 128-byte swizzled row of bf16
inline constexpr int kFlagInts = 1024;    // the workspace's flags (one per CTA) ahead of its slots

enum class SegmentKind { whole, part, head };

struct Segment {
  int tile = 0;
  int k_begin = 0, k_end = 0;  // k-blocks [k_begin, k_end) of the tile
  SegmentKind kind = SegmentKind::whole;
};

struct Schedule {
  int tiles = 0, k_blocks = 0, ctas = 0;

  // `sms` CTAs at most, and none without a unit.
  static DFLASHD_HOST_DEVICE Schedule make(int64_t n, int64_t k, int sms) {
    Schedule s;
    s.tiles = static_cast<int>((n + kRowsPerTile - 1) / kRowsPerTile);
    s.k_blocks = static_cast<int>((k + kBlockK - 1) / kBlockK);
    const int64_t units = s.units();
    s.ctas = static_cast<int>(units < sms ? units : sms);
    return s;
  }

  DFLASHD_HOST_DEVICE int64_t units() const { return static_cast<int64_t>(tiles) * k_blocks; }
  DFLASHD_HOST_DEVICE int64_t begin(int cta) const { return units() * cta / ctas; }

  // The segment that starts at unit u of a range ending at `end`.
  DFLASHD_HOST_DEVICE Segment segment(int64_t u, int64_t end) const {
    Segment g;
    g.tile = static_cast<int>(u / k_blocks);
    const int64_t tile_begin = static_cast<int64_t>(g.tile) * k_blocks;
    g.k_begin = static_cast<int>(u - tile_begin);
    g.k_end = static_cast<int>(end - tile_begin < k_blocks ? end - tile_begin : k_blocks);
    g.kind = g.k_begin > 0 ? SegmentKind::part : g.k_end < k_blocks ? SegmentKind::head : SegmentKind::whole;
    return g;
  }

  // The CTAs after `cta` whose first segment is part of `tile` (a head's followers): cta + 1 up to
  // and excluding the returned CTA.
  DFLASHD_HOST_DEVICE int followers_end(int cta, int tile) const {
    const int64_t tile_end = static_cast<int64_t>(tile + 1) * k_blocks;
    int f = cta + 1;
    while (f < ctas && begin(f) < tile_end) ++f;
    return f;
  }
};

}  // namespace dflash::stream_gemm
