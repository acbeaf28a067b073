// IpcCloser (contract in ipc_closer.h).
#include "cuda/ipc_closer.h"

#include <cuda_runtime.h>

#include <chrono>
#include <utility>

namespace linkwise::cuda {

void IpcCloser::post(void* mapped) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_.push_back(mapped);
  if (!thread_.joinable() && !stop_) thread_ = OwnedThread([this] { run(); });
  cv_.notify_one();
}

size_t IpcCloser::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + closing_;
}

void IpcCloser::close_all(std::vector<void*>& batch) {
  for (void* p : batch) cudaIpcCloseMemHandle(p);
  cudaGetLastError();  // a failed close is not the next launch's error
  batch.clear();
}

void IpcCloser::run() {
  cudaSetDevice(device_);  // the mappings were opened in this device's (primary) context
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty() || stop_) return;  // finish() closes what is left
    std::vector<void*> batch;
    batch.swap(queue_);
    closing_ = batch.size();
    lock.unlock();
    for (;;) {
      {
        std::lock_guard<std::mutex> gate(gate_);
        if (quiet_()) {
          close_all(batch);  // waits for the device's earlier work (the reason for this thread)
          break;
        }
      }
      std::unique_lock<std::mutex> l(mu_);
      if (cv_.wait_for(l, std::chrono::microseconds(kPollUs), [this] { return stop_; })) break;
    }
    lock.lock();
    queue_.insert(queue_.end(), batch.begin(), batch.end());  // not closed: stopped meanwhile
    closing_ = 0;
  }
}

void IpcCloser::finish() {
  if (getpid() != maker_) return;  // a forked child's copy: the thread is the parent's
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  std::vector<void*> left;  // everything not closed yet (the caller synchronised the device)
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(queue_);
  }
  if (left.empty()) return;
  int prev = -1;
  cudaGetDevice(&prev);
  cudaSetDevice(device_);
  close_all(left);
  if (prev >= 0 && prev != device_) cudaSetDevice(prev);
}

}  // namespace linkwise::cuda
