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

const KernelConfig kSm90Configs[] = {
    {"sm90 swapab 64x16x256 c1x1 ws", RunSm90Config0},
    {"sm90 swapab 64x32x256 c1x1 ws", RunSm90Config1},
    {"sm90 swapab 128x32x256 c1x1 coop", RunSm90Config2},
    {"sm90 swapab 64x64x256 c1x1 pingpong", RunSm90Config3},
    {"sm90 64x128x128 c2x1 pingpong", RunSm90Config4},
    {"sm90 128x128x128 c2x1 pingpong", RunSm90Config5},
    {"sm90 128x256x128 c2x1 coop", RunSm90Config6},
    {"sm90 256x128x128 c2x1 coop", RunSm90Config7},
};
const int kNumSm90Configs = sizeof(kSm90Configs) / sizeof(kSm90Configs[0]);

int ChooseSm90Config(int m, int /*n*/, int /*k*/) {
  // Measured on the H200, 2026-11-30 (bench/tune_gemm.py over 8B qkv/gate_up/down and 70B
  // qkv/down; the config with the highest summed TFLOP/s per M bucket).
  if (m <= 8) return 0;     // swap-AB 64x16x256 ws
  if (m <= 16) return 1;    // swap-AB 64x32x256 ws
  if (m <= 32) return 2;    // swap-AB 128x32x256 coop
  if (m <= 64) return 3;    // swap-AB 64x64x256 ping-pong
  if (m <= 128) return 4;   // 64x128x128 ping-pong
  if (m <= 2048) return 5;  // 128x128x128 ping-pong
  if (m <= 4096) return 7;  // 256x128x128 coop
  return 6;                 // 128x256x128 coop
}

}  // namespace modelopt_jax::cuda
