// sm90a weight-streaming grouped configurations for a few token rows per expert (decode; see
// fp8_grouped_stream_kernel.cuh, the table and the choice are in sm90_grouped_configs.cu).
#include "fp8_grouped_stream_kernel.cuh"

namespace modelopt_jax::cuda {

// Config<token rows per pass, warps, 16-row tiles per warp, steps per warp pass, row groups of warps>
using GroupedStream64x8 = grouped_stream::Config<8, 8, 1, 4, 4>;
using GroupedStream32x8 = grouped_stream::Config<8, 8, 1, 4, 2>;
using GroupedStream32x8U2 = grouped_stream::Config<8, 8, 1, 2, 2>;
using GroupedStream64x16 = grouped_stream::Config<16, 8, 1, 4, 4>;
using GroupedStream64x8U2 = grouped_stream::Config<8, 8, 1, 2, 4>;
using GroupedStream32x8W4U2 = grouped_stream::Config<8, 4, 1, 2, 2>;
// 16 weight rows and eight K slices per CTA: a few passes per warp and many CTAs, for the fewest rows
// (one token's experts: the 32- and 64-row tiles leave each warp 8 passes in a row and the GPU a
// dozen warps per SM; the dense kernel's best tiles were 16 rows)
using GroupedStream16x8U2 = grouped_stream::Config<8, 8, 1, 2, 1>;
using GroupedStream16x8 = grouped_stream::Config<8, 8, 1, 4, 1>;

size_t Sm90GroupedStream64x8Workspace(const GroupedLaunchArgs& p) { return GroupedStream64x8::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedStream64x8(const GroupedLaunchArgs& p, void* ws) { return GroupedStream64x8::Run(p, ws); }
size_t Sm90GroupedStream32x8Workspace(const GroupedLaunchArgs& p) { return GroupedStream32x8::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedStream32x8(const GroupedLaunchArgs& p, void* ws) { return GroupedStream32x8::Run(p, ws); }
size_t Sm90GroupedStream32x8U2Workspace(const GroupedLaunchArgs& p) { return GroupedStream32x8U2::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedStream32x8U2(const GroupedLaunchArgs& p, void* ws) { return GroupedStream32x8U2::Run(p, ws); }
size_t Sm90GroupedStream64x16Workspace(const GroupedLaunchArgs& p) { return GroupedStream64x16::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedStream64x16(const GroupedLaunchArgs& p, void* ws) { return GroupedStream64x16::Run(p, ws); }
size_t Sm90GroupedStream64x8U2Workspace(const GroupedLaunchArgs& p) { return GroupedStream64x8U2::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedStream64x8U2(const GroupedLaunchArgs& p, void* ws) { return GroupedStream64x8U2::Run(p, ws); }
size_t Sm90GroupedStream32x8W4U2Workspace(const GroupedLaunchArgs& p) { return GroupedStream32x8W4U2::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedStream32x8W4U2(const GroupedLaunchArgs& p, void* ws) { return GroupedStream32x8W4U2::Run(p, ws); }
size_t Sm90GroupedStream16x8U2Workspace(const GroupedLaunchArgs& p) { return GroupedStream16x8U2::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedStream16x8U2(const GroupedLaunchArgs& p, void* ws) { return GroupedStream16x8U2::Run(p, ws); }
size_t Sm90GroupedStream16x8Workspace(const GroupedLaunchArgs& p) { return GroupedStream16x8::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedStream16x8(const GroupedLaunchArgs& p, void* ws) { return GroupedStream16x8::Run(p, ws); }

}  // namespace modelopt_jax::cuda
