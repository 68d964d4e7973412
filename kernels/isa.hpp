// The instruction set the per-ISA kernel builds are chosen by, detected once per process.
#pragma once

namespace cam::kernels {

enum class Isa { kDefault, kAvx2, kAvx512 };
Isa isa();
const char* isa_name(Isa isa);  // "avx512", "avx2" or "default"

}  // namespace cam::kernels
