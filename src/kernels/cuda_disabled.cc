// The launchers of ce_launch.h in a build without CUDA (THDPACK_WITH_CUDA off, or no nvcc):
// each says so, and thdpack/cuda_loss.h's calls return Unimplemented.
#include "kernels/ce_launch.h"

namespace thdpack::kernels {

int CeFused(const CeArgs&, int, void*) { return kCeNotBuilt; }
int CePartials(const CeArgs&, int, void*) { return kCeNotBuilt; }
int CeCombine(const void*, int, int64_t, void*, void*) { return kCeNotBuilt; }
int CeFinish(const CeArgs&, int, void*) { return kCeNotBuilt; }
int CeOneRead(const CeArgs&, int, int64_t, int, void*) { return kCeNotBuilt; }
int CeScaleGrad(int, void*, int64_t, int64_t, int64_t, const float*, void*) { return kCeNotBuilt; }
int CeLogprobGrad(const CeLogprobGradArgs&, void*) { return kCeNotBuilt; }
const char* CeErrorString(int) { return "thdpack was built without CUDA"; }
bool CeBuilt() { return false; }

}  // namespace thdpack::kernels
