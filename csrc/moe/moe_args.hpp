// The argument checks of the two MoE ops, one statement for every group kind: MoeGroup (one
// host, moe_group.cpp) and HostsMoe (across hosts, hosts_moe.cpp) refuse the same inputs with
// the same words. Each throws ArgumentError with the reason alone; the caller turns it into a
// refusal that every rank of the op sees, so the group stays usable.
#pragma once

#include "moe_ops.hpp"

namespace cam {

// Everything the dispatch reads: devices, contiguity, dtypes, shapes, capacity of the outputs.
void check_dispatch_args(const MoeDispatchArgs& a, int rank, int size);
// Everything the combine reads, segment bounds included.
void check_combine_args(const MoeCombineArgs& a, int size);

}  // namespace cam
