// The sm90a grouped-GEMM configuration table and its choice by rows per expert.
#include "grouped_launch.h"

namespace modelopt_jax::cuda {

size_t Sm90GroupedSwap16Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedSwap16(const GroupedLaunchArgs&, void*);
size_t Sm90GroupedSwap64Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedSwap64(const GroupedLaunchArgs&, void*);
size_t Sm90Grouped128x128Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90Grouped128x128(const GroupedLaunchArgs&, void*);
size_t Sm90Grouped128x256Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90Grouped128x256(const GroupedLaunchArgs&, void*);
size_t Sm90GroupedStream64x8Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedStream64x8(const GroupedLaunchArgs&, void*);
size_t Sm90GroupedStream32x8Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedStream32x8(const GroupedLaunchArgs&, void*);
size_t Sm90GroupedStream32x8U2Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedStream32x8U2(const GroupedLaunchArgs&, void*);
size_t Sm90GroupedStream64x16Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedStream64x16(const GroupedLaunchArgs&, void*);
size_t Sm90GroupedStream64x8U2Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedStream64x8U2(const GroupedLaunchArgs&, void*);
size_t Sm90GroupedStream32x8W4U2Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedStream32x8W4U2(const GroupedLaunchArgs&, void*);
size_t Sm90GroupedStream16x8U2Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedStream16x8U2(const GroupedLaunchArgs&, void*);
size_t Sm90GroupedStream16x8Workspace(const GroupedLaunchArgs&);
LaunchStatus RunSm90GroupedStream16x8(const GroupedLaunchArgs&, void*);

const GroupedKernelConfig kSm90GroupedConfigs[] = {
    {"sm90 grouped swapab 64x16x256 pingpong", Sm90GroupedSwap16Workspace, RunSm90GroupedSwap16},
    {"sm90 grouped swapab 64x64x256 pingpong", Sm90GroupedSwap64Workspace, RunSm90GroupedSwap64},
    {"sm90 grouped 128x128x128 pingpong", Sm90Grouped128x128Workspace, RunSm90Grouped128x128},
    {"sm90 grouped 128x256x128 coop", Sm90Grouped128x256Workspace, RunSm90Grouped128x256},
    // weight-streaming (fp8_grouped_stream_kernel.cuh): float32 accumulation, no setup kernel or workspace
    {"sm90 grouped stream 64x8 4x2 warps", Sm90GroupedStream64x8Workspace, RunSm90GroupedStream64x8},
    {"sm90 grouped stream 32x8 2x4 warps", Sm90GroupedStream32x8Workspace, RunSm90GroupedStream32x8},
    {"sm90 grouped stream 32x8 2x4 warps unroll 2", Sm90GroupedStream32x8U2Workspace, RunSm90GroupedStream32x8U2},
    {"sm90 grouped stream 64x16 4x2 warps", Sm90GroupedStream64x16Workspace, RunSm90GroupedStream64x16},
    {"sm90 grouped stream 64x8 4x2 warps unroll 2", Sm90GroupedStream64x8U2Workspace, RunSm90GroupedStream64x8U2},
    {"sm90 grouped stream 32x8 2x2 warps unroll 2", Sm90GroupedStream32x8W4U2Workspace, RunSm90GroupedStream32x8W4U2},
    {"sm90 grouped stream 16x8 8 warps unroll 2", Sm90GroupedStream16x8U2Workspace, RunSm90GroupedStream16x8U2},
    {"sm90 grouped stream 16x8 8 warps", Sm90GroupedStream16x8Workspace, RunSm90GroupedStream16x8},
};
const int kNumSm90GroupedConfigs = sizeof(kSm90GroupedConfigs) / sizeof(kSm90GroupedConfigs[0]);

int ChooseSm90GroupedConfig(int m, int /*n*/, int k, int groups) {
  // Few rows in all: the streaming kernel, by GPU kernel time on an H100 (bench/grouped_gemm.py
  // --device-timing, 2026-12-07). One token's top-8 (8 rows) on Qwen3-30B-A3B's experts (K 2048 /
  // 768): 13.8 vs 18.3 us gate_up, 8.4 vs 14.4 down; 8 tokens (64 rows over 56 experts): 72.2 vs
  // 71.9 and 41.1 vs 44.6 (32-row tiles). Padded engine steps hand it 64 rows with the padding
  // routed to no expert. On long K (Mixtral down, K 14336) unroll 4: 44.1 vs 49.4 at 2 rows; at K
  // 4096 (Mixtral gate_up) CUTLASS stayed ahead (86.4 vs 87.4).
  if (m <= 8 && k <= 2048) return 8;
  if (m <= 64 && k <= 2048) return 9;
  if (m <= 8 && k >= 8192) return 4;
  // Else rows per expert under uniform routing. 16 per expert (Mixtral, 64 tokens x top-2 over 8)
  // ran 355 / 174 us in swap-AB 64x64 against 434 / 235 in 64x16 on the same H100 run; 1-4 per
  // expert (Qwen3-30B-A3B at 8-64 tokens) stayed fastest in 64x16.
  const int per_group = groups > 0 ? (m + groups - 1) / groups : m;
  if (per_group <= 8) return 0;
  if (per_group <= 64) return 1;
  if (per_group <= 1024) return 2;
  return 3;
}

}  // namespace modelopt_jax::cuda
