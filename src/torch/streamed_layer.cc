// StreamedLayer's arena block and what it holds: a new block filled (or found filled in the host's shared
// copy) and installed, the process's host memory counts, the layer's registration in the current engine,
// and whether the Parameters are still what was packed (refresh() packs again when they are not).
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>

#include "host_share.h"
#include "layerstream/check.h"
#include "layerstream/log.h"
#include "streamed_layer_internal.h"

namespace layerstream::torchglue {

using detail::align_up;
using detail::device_bytes;
using detail::is_python_tensor;
using detail::view_of;

namespace {

// host_memory_counts(): process-wide totals, changed only by BlockAccount and count_pageable_locked().
std::atomic<std::int64_t> g_pinned_packed{0}, g_pinned_plain{0}, g_pageable{0};

// One arena block's bytes in host_memory_counts(), for as long as anything holds the block (the layer, or
// the storage of a view of it: a Parameter, a PackedWeight's packed bytes). Shared segments are not
// counted (host_shared_bytes has them).
struct BlockAccount {
  BlockAccount(std::shared_ptr<HostBlockRef> b, std::size_t packed) : block(std::move(b)) {
    if (block->segment() != nullptr) return;
    const auto total = static_cast<std::int64_t>(block->block().bytes);
    const auto pk = std::min<std::int64_t>(total, static_cast<std::int64_t>(packed));
    if (block->block().pinned) {
      packed_bytes = pk;
      plain_bytes = total - pk;
    } else {
      pageable_bytes = total;
    }
    g_pinned_packed += packed_bytes;
    g_pinned_plain += plain_bytes;
    g_pageable += pageable_bytes;
  }
  ~BlockAccount() {
    g_pinned_packed -= packed_bytes;
    g_pinned_plain -= plain_bytes;
    g_pageable -= pageable_bytes;
  }
  BlockAccount(const BlockAccount&) = delete;
  BlockAccount& operator=(const BlockAccount&) = delete;
  std::shared_ptr<HostBlockRef> block;
  std::int64_t packed_bytes = 0, plain_bytes = 0, pageable_bytes = 0;
};

}  // namespace

HostMemoryCounts host_memory_counts() {
  HostMemoryCounts c;
  c.pinned_packed = g_pinned_packed.load();
  c.pinned_plain = g_pinned_plain.load();
  c.pageable = g_pageable.load();
  return c;
}

void StreamedLayer::count_pageable_locked(std::int64_t bytes) {
  g_pageable += bytes - block_.pageable;
  block_.pageable = bytes;
}

StreamedLayer::StreamedLayer(std::shared_ptr<DeviceState> state, LayerKind kind, ConvParams conv)
    : state_(std::move(state)), kind_(kind), conv_(std::move(conv)) {}

StreamedLayer::~StreamedLayer() {
  count_pageable_locked(0);
  if (TransferEngine* engine = engine_if_registered()) {
    try {
      // Its model is gone (freed, or detached): memory the budget's plan kept for it is free for the others.
      if (const std::size_t resident = engine->remove_layer(registered_.id)) state_->note_resident_layer_gone(resident);
    } catch (const std::exception& e) {
      log(LogLevel::kWarning, std::string("unregistering a layer failed: ") + e.what());
    }
  }
}

TransferEngine* StreamedLayer::engine_if_registered() {
  if (registered_.id == 0 || registered_.generation != state_->generation()) return nullptr;
  return state_->current_engine();
}

std::size_t StreamedLayer::packed_bytes() const { return block_.ref ? block_.ref->block().bytes : 0; }

bool StreamedLayer::matches(const Packed& p, const at::Tensor& t) {
  if (!p.defined) return !t.defined();
  if (p.wrapped || is_python_tensor(t)) {  // a PackedWeight: the object itself, nothing to look inside
    return p.wrapped && t.defined() && p.impl && t.unsafeGetTensorImpl() == p.impl->_unsafe_get_target();
  }
  const c10::StorageImpl* storage = t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  return t.defined() && p.impl && t.unsafeGetTensorImpl() == p.impl->_unsafe_get_target() &&
         storage == (p.storage ? p.storage->_unsafe_get_target() : nullptr) && t.data_ptr() == p.data;
}

std::shared_ptr<HostBlockRef> StreamedLayer::new_block(const std::vector<std::pair<Packed*, at::Tensor>>& parts,
                                                       std::vector<at::Tensor>& views, bool shareable,
                                                       std::size_t packed, const std::function<void(char*)>& encode) {
  std::size_t total = 0;
  for (const auto& [p, src] : parts) {
    p->offset = align_up(total);
    total = p->offset + p->bytes;
  }
  LS_CHECK_ARG(total > 0, "a managed layer needs a non-empty weight");
  auto fill = [&](char* base) {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const auto& [p, src] = parts[i];
      if (i == 0 && encode) {
        encode(base + p->offset);
      } else {
        view_of(base, *p, at::kCPU).copy_(src.detach());
      }
    }
  };

  std::shared_ptr<HostBlockRef> block;
  HostShare* share = shareable ? HostShare::get() : nullptr;
  std::unique_ptr<SharedHostSegment> segment = share ? share->next(state_->backend(), total) : nullptr;
  if (segment && segment->data() != nullptr) {
    // The leader fills the host's copy; the other ranks find it filled (they waited for it).
    const bool leader = segment->leader();
    if (leader) {
      fill(static_cast<char*>(segment->data()));
      segment->mark_ready();
    }
    block = std::make_shared<HostBlockRef>(state_->pool(), std::move(segment));
    if (!block->block().pinned) {
      log_once("share-unpinned", LogLevel::kWarning,
               "the shared host copy could not be pinned (read-only registration refused): its copies go "
               "through pinned bounce buffers, which is slower; LAYERSTREAM_SHARE_HOST=0 gives each rank a "
               "pinned copy of its own");
    }
    if (!leader) {
      // The shared copy must be what this rank would have packed: a rank that loaded other weights
      // would otherwise train on rank 0's without a word.
      at::NoGradGuard no_grad;
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const auto& [p, src] = parts[i];
        at::Tensor mine = at::empty_strided(p->sizes, p->strides, at::TensorOptions().dtype(p->dtype));
        if (i == 0 && encode) {
          encode(static_cast<char*>(mine.data_ptr()));
        } else {
          mine.copy_(src.detach());
        }
        LS_CHECK(std::memcmp(mine.data_ptr(), block->data() + p->offset, p->bytes) == 0,
                 "this rank's weights differ from the host copy that local rank 0 packed (a tensor of shape ",
                 at::IntArrayRef(p->sizes), "): every rank must load the same model; LAYERSTREAM_SHARE_HOST=0 "
                 "gives each rank a copy of its own");
      }
    }
  } else {
    if (segment) {
      log_once("share-refused", LogLevel::kWarning,
               "the host refused shared memory for the weights (is /dev/shm large enough? docker: --shm-size); "
               "each rank keeps a copy of its own");
    }
    block = std::make_shared<HostBlockRef>(state_->pool(), total);
    fill(block->data());
  }
  views.clear();
  auto account = std::make_shared<BlockAccount>(block, packed);
  for (const auto& [p, src] : parts) {
    // The view's storage owns a reference to the block (through its account): the host bytes live as long
    // as any tensor (or this layer) uses them.
    auto keep = account;
    views.push_back(view_of(block->data(), *p, at::kCPU, [keep](void*) {}));
  }
  block_.new_account = std::move(account);
  return block;
}

void StreamedLayer::install(std::shared_ptr<HostBlockRef> block, const StoredForm* form, Packed w, Packed b,
                            std::optional<QuantParts> q) {
  // A resident layer packed again keeps its place on the device (the plan chose the layer, not its block);
  // a trainable one streams, copied fresh at every use.
  TransferEngine* engine = engine_if_registered();
  const std::size_t resident = engine != nullptr ? engine->remove_layer(registered_.id) : 0;
  registered_.resident_before = fresh_each_use_.load(std::memory_order_relaxed) ? 0 : resident;
  registered_.id = 0;
  registered_.generation = 0;
  block_.ref = std::move(block);
  block_.account = std::move(block_.new_account);
  packed_.weight_form = form;
  packed_.weight = std::move(w);
  packed_.bias = std::move(b);
  packed_.quant = std::move(q);
  packing_.fetch_add(1, std::memory_order_relaxed);
  registered_.scratch = scratch_bytes_locked();  // once per packing, not per call
  // The first ring is sized for the largest layer, its scratch included.
  state_->note_attached(device_bytes(block_.ref->block().bytes, registered_.scratch));
}

TransferEngine& StreamedLayer::registered_engine() {
  std::lock_guard<std::mutex> lock(mu_);
  TransferEngine& engine = state_->engine_for(device_bytes(block_.ref->block().bytes, registered_.scratch));
  if (registered_.id == 0 || registered_.generation != state_->generation()) {
    registered_.id = engine.add_external_layer(block_.ref->block(), registered_.scratch, fill_hook_locked());
    registered_.generation = state_->generation();
    state_->consider_residency(engine, registered_.id, block_.ref->block().bytes, registered_.resident_before);
    registered_.resident_before = 0;
  }
  return engine;
}

bool StreamedLayer::tensors_current(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tensors.size() != packed_.tensors.size()) return false;
  bool modified = false;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!matches(packed_.tensors[i], tensors[i])) return false;
    modified = modified || tensors[i]._version() != packed_.tensors[i].version;
  }
  if (modified) {  // changed in place (a requantize): the arena holds the new bytes; the device copy is stale
    if (TransferEngine* engine = engine_if_registered()) engine->begin_host_write(registered_.id);
    for (std::size_t i = 0; i < tensors.size(); ++i) packed_.tensors[i].version = tensors[i]._version();
  }
  return true;
}

std::string StreamedLayer::stored_as() const {
  if (packed_.quant && packed_.quant->lossless) return "lossless " + std::string(c10::toString(packed_.quant->result));
  if (!packed_.tensors.empty()) return std::string(c10::toString(packed_.tensors.front().dtype));  // the first buffer's
  return std::string(c10::toString(packed_.weight.dtype));
}

bool StreamedLayer::is_current(const at::Tensor& weight, const at::Tensor& bias) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!matches(packed_.weight, weight) || !matches(packed_.bias, bias)) return false;  // replaced, or data swapped
  const bool w_same = weight._version() == packed_.weight.version;
  const bool b_same = !packed_.bias.defined || bias._version() == packed_.bias.version;
  if (w_same && b_same) return true;
  // Codes made from the weight's values, or a tied weight's copy in this block, must be made again.
  if (!w_same && (packed_.quant || packed_.weight_tied)) return false;
  // Modified in place (an optimizer step on a trainable layer): the arena holds the new bytes already;
  // the device copy is stale.
  if (TransferEngine* engine = engine_if_registered()) engine->begin_host_write(registered_.id);
  packed_.weight.version = weight._version();
  if (packed_.bias.defined) packed_.bias.version = bias._version();
  return true;
}

StreamedLayer::Refreshed StreamedLayer::refresh(const at::Tensor& weight, const at::Tensor& bias) {
  // LAYERSTREAM_HOST_DTYPE applies to frozen weights: one frozen after it was packed gets compressed now,
  // one made trainable again is stored as it is (its gradient and updates need the exact values).
  const bool compress_now = takes_.compress_frozen && !packed_.quant && !weight.requires_grad();
  const bool expand_now = packed_.quant && packed_.quant->compressed && weight.requires_grad();
  // A shared (read-only) block whose weight or bias became trainable gets a copy of this rank's own
  // before its optimizer writes to it.
  const bool shared = block_.ref && block_.ref->segment() != nullptr;
  const bool trainable = weight.requires_grad() || (bias.defined() && bias.requires_grad());
  fresh_each_use_.store(trainable, std::memory_order_relaxed);
  const bool unshare_now = shared && trainable;
  if (compress_now || expand_now || unshare_now || !is_current(weight, bias)) pack(weight, bias, packed_.weight_tied);
  return Refreshed(this);
}

}  // namespace layerstream::torchglue
