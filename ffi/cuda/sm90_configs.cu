// The sm90a configuration table and the M-bucket choice (tuned by bench/tune_gemm.py; the
// measured table is in bench/RESULTS.md).
#include "gemm_launch.h"

namespace modelopt_jax::cuda {

LaunchStatus RunSm90Config0(const LaunchArgs&);
LaunchStatus RunSm90Config1(const LaunchArgs&);
LaunchStatus RunSm90Config2(const LaunchArgs&);
LaunchStatus RunSm90Config3(const LaunchArgs&);
LaunchStatus RunSm90Config4(const LaunchArgs&);
LaunchStatus RunSm90Config5(const LaunchArgs&);
LaunchStatus RunSm90Config6(const LaunchArgs&);
LaunchStatus RunSm90Config7(const LaunchArgs&);
LaunchStatus RunSm90Stream16x8W4(const LaunchArgs&);
LaunchStatus RunSm90Stream16x8W8(const LaunchArgs&);
LaunchStatus RunSm90Stream16x16W8(const LaunchArgs&);
LaunchStatus RunSm90Stream32x8W8(const LaunchArgs&);
LaunchStatus RunSm90Stream64x8W8(const LaunchArgs&);
LaunchStatus RunSm90Stream64x16W8(const LaunchArgs&);

const KernelConfig kSm90Configs[] = {
    {"sm90 swapab 64x16x256 c1x1 ws", RunSm90Config0},
    {"sm90 swapab 64x32x256 c1x1 ws", RunSm90Config1},
    {"sm90 swapab 128x32x256 c1x1 coop", RunSm90Config2},
    {"sm90 swapab 64x64x256 c1x1 pingpong", RunSm90Config3},
    {"sm90 64x128x128 c2x1 pingpong", RunSm90Config4},
    {"sm90 128x128x128 c2x1 pingpong", RunSm90Config5},
    {"sm90 128x256x128 c2x1 coop", RunSm90Config6},
    {"sm90 256x128x128 c2x1 coop", RunSm90Config7},
    {"sm90 stream 16x8 4 warps", RunSm90Stream16x8W4},
    {"sm90 stream 16x8 8 warps", RunSm90Stream16x8W8},
    {"sm90 stream 16x16 8 warps", RunSm90Stream16x16W8},
    {"sm90 stream 32x8 2x4 warps", RunSm90Stream32x8W8},
    {"sm90 stream 64x8 4x2 warps", RunSm90Stream64x8W8},
    {"sm90 stream 64x16 4x2 warps", RunSm90Stream64x16W8},
};
const int kNumSm90Configs = sizeof(kSm90Configs) / sizeof(kSm90Configs[0]);

namespace {

// Output tiles of an M x N GEMM under TM x TN tiles.
int Tiles(int m, int n, int tm, int tn) { return ((m + tm - 1) / tm) * ((n + tn - 1) / tn); }

// Below this many output tiles a configuration leaves much of the H200's 132 SMs idle (there is no
// split-K): a smaller tile that fills them wins at mid M (tune_gemm.py --device-timing, 2026-12-02).
constexpr int kFewTiles = 80;

}  // namespace

int ChooseSm90Config(int m, int n, int /*k*/) {
  // Measured on the H200, 2026-11-30 (bench/tune_gemm.py over 8B qkv/gate_up/down and 70B
  // qkv/down; the config with the highest summed TFLOP/s per M bucket), and for narrow N at mid M
  // on 2026-12-02 (GPU kernel time, 8B qkv/o/gate_up/down at M 64/128/256): N = 4096 (o, down) at
  // M = 256 takes 64x128 ping-pong (o 814 vs 617 TFLOP/s, down 1063 vs 803), at M = 128 swap-AB
  // 64x64 (o 519 vs 442, down 756 vs 647); qkv (N = 6144) and gate_up keep the bucket's choice.
  // M 17-32 by GPU kernel time on 2026-12-06 (bench/results/stream_v1_tune_h200_2026-12-06d.json;
  // the 2026-11-30 choice was by wall time, whose ~15 us per call hid these kernels): swap-AB
  // 64x32 over 128x32 coop, 8B qkv 9.1 vs 10.3 us, o 6.7 vs 9.4, gate_up 32.9 vs 33.7, down 16.5
  // vs 23.9 (12 us less per 8B layer), 70B down 54.7 vs 57.1; 128x32 leads only on 70B qkv (23.1
  // vs 24.5) and the 8B lm_head (127.4 vs 128.2). At M 9-16 the same run has 64x16 ahead of 64x32
  // on all seven shapes it timed, by 1-2% (8B layer 64.2 vs 65.5 us).
  if (m <= 16) return 0;    // swap-AB 64x16x256 ws
  if (m <= 32) return 1;    // swap-AB 64x32x256 ws
  if (m <= 64) return 3;    // swap-AB 64x64x256 ping-pong
  if (m <= 128) return Tiles(m, n, 64, 128) < kFewTiles ? 3 : 4;   // 64x128x128 ping-pong, or swap-AB 64x64
  if (m <= 2048) return Tiles(m, n, 128, 128) < kFewTiles ? 4 : 5;  // 128x128x128 ping-pong, or 64x128
  if (m <= 4096) return 7;  // 256x128x128 coop
  return 6;                 // 128x256x128 coop
}

}  // namespace modelopt_jax::cuda
