// Small all_gather, reduce_scatter and all_to_all through the shared-memory segment: one
// one-shot round each (larger reduce_scatters: two-shot rounds, shm_coll.cc) (see ShmColl::exchange in algo/shm_coll.h). Through point-to-point
// messages these cost one message per peer and the engine's matching (~8-14 us for 2 ranks
// on the 2-core VM); here a copy in, one counter and the reads.
#include "algo/shm_coll.h"
#include "algo/shm_coll_slot.h"
#include "core/copy.h"
#include "core/reduce.h"
#include "core/status.h"

namespace linkwise {

namespace {
const char* kind_name(ShmColl::CallKind kind) {
  switch (kind) {
    case ShmColl::kAllGather: return "all_gather";
    case ShmColl::kReduceScatter: return "reduce_scatter";
    default: return "all_to_all";
  }
}
}  // namespace

void ShmColl::exchange(CallKind kind, const void* in, size_t in_bytes, void* out, DType t, RedOp op,
                       double timeout) {
  if (kind != kAllGather && kind != kReduceScatter && kind != kAllToAll)
    throw Error(ErrorKind::Invalid, "shared-memory exchange: not an all_gather, reduce_scatter or all_to_all");
  if (in_bytes > kOneMax && kind != kReduceScatter)
    throw Error(ErrorKind::Invalid, std::string(kind_name(kind)) + ": " + std::to_string(in_bytes) +
                                        " bytes do not fit the shared-memory one-shot area");
  timeout_ = timeout;
  // The descriptor carries dtype and op only where they matter (reduce_scatter).
  begin_call(kind, in_bytes, kind == kReduceScatter ? t : DType::kCount, kind == kReduceScatter ? op : RedOp::kCount,
             0);
  try {
    if (in_bytes > kOneMax) return reduce_scatter(in, out, in_bytes / n_ / dtype_size(t), t, op);
    const uint32_t r = one_shot_post(in, in_bytes);
    one_shot_wait(r, kind_name(kind));
    char* o = static_cast<char*>(out);
    if (kind == kAllGather) {
      for (int q = 0; q < n_; ++q) copy_bytes(o + q * in_bytes, slot(q)->one(r), in_bytes);
      return;
    }
    const size_t block = in_bytes / n_;
    if (kind == kAllToAll) {
      for (int q = 0; q < n_; ++q) copy_bytes(o + q * block, slot(q)->one(r) + rank_ * block, block);
      return;
    }
    one_shot_combine(r, out, block / dtype_size(t), t, op, rank_ * block);
  } catch (const Error& e) {
    mark_failed(e);
    throw;
  }
}

}  // namespace linkwise
