// python/src/media_py.h: media (thdpack/media.h) at the torch step's edge - a fed sample's
// media, the iterator's media options and a rank's media of a microbatch as Python values.
// Conversions only (bind_media.cc); every rule is the library's.
#ifndef THDPACK_PYTHON_MEDIA_PY_H_
#define THDPACK_PYTHON_MEDIA_PY_H_

#include <string>

#include "common.h"
#include "thdpack/step_runner.h"

namespace thdpack::python {

// A fed sample's media - per declared modality (int64 grid [3k], seconds or None, payload dtype
// name, row width, uint8 payload bytes) - into out.media. InvalidArgument naming `where`.
Status MediaFromPy(const py::handle& parts, const std::string& where, Sample& out);

// media=(specs [(name, token_id, timed)], spatial_merge_size, mrope, mrope_tokens_per_second,
// (per_patch, per_frame_sq) or None) into the runner's options; the runner checks them.
void SetMediaOptions(const py::handle& media, StepRunnerOptions& ro);

// A rank's media of a microbatch (moved out): per declared modality a dict of its payload bytes,
// dtype name, width, grid_thw [k, 3], output_rows and the route's arrays; None without media.
py::object MediaToPy(MediaShard& media);
// Its mRoPE positions, int64 [3, T/CP], or None.
py::object MropeToPy(MediaShard& media);

}  // namespace thdpack::python

#endif  // THDPACK_PYTHON_MEDIA_PY_H_
