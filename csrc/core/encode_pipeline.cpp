// Parallel encode + ordered append. See encode_pipeline.hpp for the contract; comments here
// explain the mechanics.
#include "core/encode_pipeline.hpp"

#include <algorithm>
#include <atomic>
#include <deque>
#include <future>
#include <memory>
#include <stdexcept>
#include <utility>

#include "core/cancel.hpp"
#include "core/checksum.hpp"
#include "core/chunk_io.hpp"
#include "core/error.hpp"

namespace pyckpt {
// ---------------------------------------------------------------------------------------------

namespace {

struct Slot {
  std::size_t item = 0;
  bool empty_item = false;  // zero-byte item: keeps its place in the order, no task
  const std::uint8_t* src = nullptr;
  std::size_t len = 0;
  Lease lease;  // encoded bytes (zstd); empty for Codec::None
  ChunkRecord rec;
  std::future<void> done;
};

// Waits for every submitted task; never throws. Tasks reference Slots and caller memory, so no
// exit path of encode_and_write may return before they finish.
void drain(std::deque<std::unique_ptr<Slot>>& q) noexcept {
  for (auto& s : q) {
    if (s->done.valid()) s->done.wait();
  }
}

std::string item_context(const std::string& name) { return "tensor '" + name + "'"; }

}  // namespace

std::vector<WrittenItem> encode_and_write(ChunkSink& out, const std::vector<WriteRequest>& items,
                                          std::size_t chunk_bytes, ThreadPool& pool,
                                          BufferPool& blocks) {
  PYCKPT_EXPECT(chunk_bytes > 0 && chunk_bytes <= kMaxChunkBytes, std::invalid_argument,
                "chunk_bytes must be in [1, ", kMaxChunkBytes, "], got ", chunk_bytes);
  for (const WriteRequest& it : items) {
    // it.params were validated when made (pyckpt._C.CodecParams); encode_chunk re-checks them.
    PYCKPT_EXPECT(it.nbytes == 0 || it.data != nullptr, std::invalid_argument, "tensor '", it.name,
                  "': null data pointer for ", it.nbytes, " bytes");
    if (it.params.codec == Codec::Zstd && it.nbytes > 0) {
      const std::size_t need =
          max_encoded_size(std::min<std::uint64_t>(chunk_bytes, it.nbytes), it.params);
      PYCKPT_EXPECT(blocks.block_bytes() >= need, std::invalid_argument, "encode blocks of ",
                    blocks.block_bytes(), " bytes are smaller than ", need,
                    " (max_encoded_size of chunk_bytes=", chunk_bytes, ")");
    }
  }

  std::vector<WrittenItem> results(items.size());
  // Set on the first failure (or Ctrl-C): chunks still queued on the pool skip their work, so
  // the drain below waits only for the ones already running.
  std::atomic<bool> abandoned{false};
  std::atomic<std::uint64_t>* const progress = progress_counter();  // the caller's, if any
  const std::size_t max_inflight = 2 * pool.size() + 2;
  std::deque<std::unique_ptr<Slot>> inflight;

  // Consumes the oldest slot in order: wait, append, record. On failure drains everything
  // first (tasks still use caller memory and pool blocks), then rethrows naming the item.
  auto consume_one = [&]() {
    Slot& s = *inflight.front();
    WrittenItem& w = results[s.item];
    if (s.empty_item) {
      w.offset = out.size();
      inflight.pop_front();
      return;
    }
    try {
      s.done.get();
      const std::uint8_t* bytes =
          s.lease ? reinterpret_cast<const std::uint8_t*>(s.lease.data()) : s.src;
      s.rec.file_offset = out.append(bytes, s.rec.stored_len);
    } catch (...) {
      const std::exception_ptr err = std::current_exception();
      abandoned.store(true, std::memory_order_relaxed);
      drain(inflight);
      rethrow_with_context(err, item_context(items[s.item].name));
    }
    if (w.chunks.empty()) w.offset = s.rec.file_offset;
    w.stored_bytes += s.rec.stored_len;
    w.chunks.push_back(std::move(s.rec));
    if (progress) progress->fetch_add(s.len, std::memory_order_relaxed);
    inflight.pop_front();  // returns the lease
  };

  try {
    for (std::size_t i = 0; i < items.size(); ++i) {
      const WriteRequest& it = items[i];
      const auto* base = static_cast<const std::uint8_t*>(it.data);
      if (it.nbytes == 0) {
        auto s = std::make_unique<Slot>();
        s->item = i;
        s->empty_item = true;
        inflight.push_back(std::move(s));
        continue;
      }
      for (std::uint64_t off = 0; off < it.nbytes; off += chunk_bytes) {
        poll_interrupt();  // Ctrl-C between chunks: the catch below drains, the caller aborts
        while (inflight.size() >= max_inflight) consume_one();
        auto s = std::make_unique<Slot>();
        s->item = i;
        s->src = base + off;
        s->len = static_cast<std::size_t>(std::min<std::uint64_t>(chunk_bytes, it.nbytes - off));
        if (it.params.codec == Codec::Zstd) {
          // Take the block here, in order, never inside a task: a task blocked on the pool
          // while the caller waits for it (and holds the blocks of later chunks) would deadlock.
          // When none is free, retire our own oldest chunk to free one; block only when the
          // pool is held by someone else.
          Lease l = blocks.try_acquire();
          while (!l) {
            if (inflight.empty()) {
              l = blocks.acquire();
            } else {
              consume_one();
              l = blocks.try_acquire();
            }
          }
          s->lease = std::move(l);
        }
        Slot* sp = s.get();
        const CodecParams* params = &it.params;
        s->done = pool.submit([sp, params, &abandoned] {
          if (abandoned.load(std::memory_order_relaxed)) return;  // the call is failing anyway
          if (sp->lease) {
            sp->rec = encode_chunk(sp->src, sp->len, *params, sp->lease.data());
          } else {
            // Codec::None: stored bytes are the source bytes; the caller appends them directly.
            sp->rec.raw_len = sp->len;
            sp->rec.stored_len = sp->len;
            sp->rec.transform = Transform::None;
            sp->rec.planes.push_back(PlaneRecord{PlaneMode::Raw, sp->len});
            sp->rec.checksum = xxh64(sp->src, sp->len);
          }
        });
        inflight.push_back(std::move(s));
      }
    }
    while (!inflight.empty()) consume_one();
  } catch (...) {
    abandoned.store(true, std::memory_order_relaxed);
    drain(inflight);  // e.g. submit() on a shut-down pool, or Ctrl-C; consume_one drained
    throw;
  }
  return results;
}

}  // namespace pyckpt
