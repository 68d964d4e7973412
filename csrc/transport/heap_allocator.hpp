// The heap allocator mode: CPU tensors of at least min_bytes are born in this process's heap
// (process_heap.hpp), so every cam group of the host reads them in place, one copy per byte
// moved, as it reads torch_cam.empty tensors. DDP buckets, FSDP2 flat parameters and the
// buffers of Megatron or DeepSpeed are ordinary allocations: with this mode they qualify too.
//
// Smaller tensors, tensors of a process forked from the heap's owner (a DataLoader worker must
// not hand out the parent's blocks), and any the heap cannot hold come from the allocator that
// was installed before. Freed blocks keep their pages for a later allocation of the same
// rounded size (a training step allocates the same shapes every step), up to kCacheBytes;
// beyond that their pages go back to the system. A cached block serves a request up to 1/8
// smaller than itself.
//
// The mode is on by default: the first cam group with two or more ranks on this host that maps
// every peer's process heap installs it (heap_allocator_group_ready) with kAutoHeapAllocatorMinBytes,
// because from then on a large tensor read in place costs one copy per byte moved where a staged
// one costs two (benchmarks/results_single_copy.md). Any explicit set_heap_allocator call, before
// or after, decides instead, and a process whose CPU allocator cannot be replaced stays as it is.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace cam {

constexpr int64_t kAutoHeapAllocatorMinBytes = int64_t(1) << 20;

// Installs the mode (min_bytes > 0), changes its threshold, or (min_bytes <= 0) restores the
// previous CPU allocator. Tensors already born in the heap stay valid either way.
void set_heap_allocator(int64_t min_bytes);
// A group whose ranks all read each other's process heaps is ready: install the mode unless a
// caller chose (set_heap_allocator) or it cannot be installed. Never throws.
void heap_allocator_group_ready() noexcept;
// installed (0/1), auto (0/1: installed by a group, not by a caller), min_bytes, heap_tensors (live), heap_bytes (live), cached_bytes,
// fallbacks (tensors large enough that the heap could not hold).
std::map<std::string, int64_t> heap_allocator_stats();

}  // namespace cam
