// all_gather, reduce_scatter, all_to_all, gather and scatter through the shared-memory
// segment: small ones in one one-shot round each (see ShmColl::exchange, gather and scatter
// in algo/shm_coll.h; larger reduce_scatters run two-shot rounds, shm_two_shot.cc, larger
// all_gathers, all_to_alls and gathers block rounds, shm_block_rounds.cc). Through
// point-to-point messages these cost one message per peer and the engine's matching (~8-14
// us for 2 ranks on the 2-core VM); here a copy in, one counter and the reads.
#include "algo/shm_coll.h"
#include "algo/shm_coll_slot.h"
#include "core/copy.h"
#include "core/reduce.h"
#include "core/status.h"

namespace linkwise {

void ShmColl::exchange(CallKind kind, const void* in, size_t in_bytes, void* out, DType t, RedOp op,
                       double timeout) {
  if (kind != kAllGather && kind != kReduceScatter && kind != kAllToAll)
    throw Error(ErrorKind::Invalid, "shared-memory exchange: not an all_gather, reduce_scatter or all_to_all");
  timeout_ = timeout;
  // The descriptor carries dtype and op only where they matter (reduce_scatter).
  begin_call(kind, in_bytes, kind == kReduceScatter ? t : DType::kCount, kind == kReduceScatter ? op : RedOp::kCount,
             0);
  try {
    if (in_bytes > kOneMax && kind == kAllGather) return block_rounds(BlockMove::kAllGather, 0, in, out, in_bytes);
    if (in_bytes > kOneMax && kind == kAllToAll) return block_rounds(BlockMove::kAllToAll, 0, in, out, in_bytes / n_);
    if (in_bytes > kOneMax) return reduce_scatter(in, out, in_bytes / n_ / dtype_size(t), t, op);
    const uint32_t r = one_shot_post(in, in_bytes);
    one_shot_wait(r, call_what());
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

void ShmColl::gather(const void* in, size_t bytes, void* out, int root, double timeout) {
  LW_CHECK(root >= 0 && root < n_ && (rank_ != root || out || bytes == 0), "gather: a root in range, with an output");
  timeout_ = timeout;
  begin_call(kGather, bytes, DType::kCount, RedOp::kCount, root);
  try {
    if (bytes * n_ > kOneMax) return block_rounds(BlockMove::kGather, root, in, rank_ == root ? out : nullptr, bytes);
    if (rank_ != root) return owe_round(one_shot_post(in, bytes));  // nobody reads the root's area
    const uint32_t r = one_shot_post(nullptr, 0);
    one_shot_wait(r, call_what());
    char* o = static_cast<char*>(out);
    for (int q = 0; q < n_; ++q) {
      const char* from = q == rank_ ? static_cast<const char*>(in) : slot(q)->one(r);
      if (from != o + q * bytes) copy_bytes(o + q * bytes, from, bytes);
    }
  } catch (const Error& e) {
    mark_failed(e);
    throw;
  }
}

void ShmColl::scatter(const void* in, void* out, size_t bytes, int root, double timeout) {
  if (bytes * n_ > kOneMax)
    throw Error(ErrorKind::Invalid, "scatter: " + std::to_string(bytes * n_) +
                                        " bytes do not fit the shared-memory one-shot area");
  LW_CHECK(root >= 0 && root < n_ && (rank_ != root || in || bytes == 0), "scatter: a root in range, with an input");
  timeout_ = timeout;
  begin_call(kScatter, bytes, DType::kCount, RedOp::kCount, root);
  try {
    // The root's own block, too, comes from its posted copy: out may overlap in anywhere.
    const uint32_t r = one_shot_post(in, rank_ == root ? bytes * n_ : 0);  // a non-root's area: unread
    if (rank_ != root) {
      wait_ge(root, slot(root)->h().b_in.v, r, call_what(), true);
      check_line(root, slot(root)->h().b_in.stamp[r & 1], true);
    }
    copy_bytes(out, slot(root)->one(r) + rank_ * bytes, bytes);
    owe_round(r);  // the other peers' posts of this round: waited for before my next post
  } catch (const Error& e) {
    mark_failed(e);
    throw;
  }
}

}  // namespace linkwise
