// Paged attention on the CPU that reads K/V blocks in place through the block table.
//
// One work item is (request, kv head, tile of query tokens): the tile's query rows (its
// tokens x the query heads that share the kv head, GQA) walk the request's context once
// with an online softmax in fp32 (attention_tile.h), so each K/V block is read once per
// item and no layer gathers a request's context. Decodes are tiles of one token; prefill
// chunks are causal over their prefix plus themselves. Items go to torch's threads
// dynamically, longest first; a few long decodes split their contexts across threads, unless the
// caller asks for batch invariance: then every row walks its context alone, in chunks aligned to
// position 0, so its sums never depend on the batch, its tile or the thread count.
//
// Cache layout [num_blocks, num_kv_heads, block_size, row]: one (block, kv head) is a contiguous
// slab of block_size rows of head_dim values of the query's type, or, in an int8 cache, of the
// block's codes and then its tokens' fp16 scales (row = head_dim + 2; kernels/kv_cache_layout.py,
// attention_int8.h); the write quantizes.

#include "attention_tile.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <vector>

namespace tandem {
namespace {

constexpr int64_t kTileRows = 32;        // query rows (tokens x grouped heads) per work item
constexpr int64_t kSerialWork = 1 << 15;  // below this many (row, key) pairs, one thread
constexpr int64_t kMinSplitChunks = 2;    // a split of a decode's context: at least this many chunks

struct Split {  // a decode whose context runs as `count` items, merged afterwards
  WorkItem whole;
  int64_t first_partial, count;
};

struct Plan {
  std::vector<WorkItem> items;  // longest first
  std::vector<Split> splits;
  int64_t partial_floats = 0, work = 0;
};

// Tiles of query rows per (request, kv head). When there are too few items to keep every
// thread busy (a few long decodes), each long decode's context is split into runs of whole
// chunks, flash-decoding style, and the runs' partial results merged.
bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t i = 0; i < a.dim(); ++i) {
    if (a.size(i) != b.size(i)) return false;
  }
  return true;
}

Plan plan(const Layout& L, int64_t num_reqs, int64_t threads, bool batch_invariant) {
  Plan p;
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / L.group);
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t begin = L.query_start_loc[b], end = L.query_start_loc[b + 1];
    const int64_t q_len = end - begin, seq_len = L.seq_lens[b];
    TANDEM_CHECK(q_len >= 1 && seq_len >= q_len, "request ", b, " has ", q_len,
                 " query tokens but a context of ", seq_len);
    for (int64_t t = begin; t < end; t += tile_tokens) {
      const int64_t t_end = std::min(end, t + tile_tokens);
      const int64_t keys = seq_len - (end - t_end);  // keys visible to the tile's last token
      // the first token's window start: keys before it are hidden from every row of the tile
      int64_t key_begin = std::max<int64_t>(0, seq_len - (end - t) - L.window + 1);
      if (batch_invariant) key_begin -= key_begin % kChunk;  // chunks at the same positions in every tile
      key_begin -= key_begin % L.key_align;  // keys before the window are masked row by row
      for (int64_t h = 0; h < L.num_kv_heads; ++h) {
        const int64_t cost = (t_end - t) * L.group * (keys - key_begin);
        p.items.push_back({int32_t(b), int32_t(h), int32_t(t), int32_t(t_end), key_begin, keys, cost, -1});
        p.work += cost;
      }
    }
  }
  const int64_t wanted = 2 * threads, have = p.items.size();
  if (!batch_invariant && threads > 1 && p.work >= kSerialWork && have < wanted) {
    std::vector<WorkItem> items;
    for (const WorkItem& w : p.items) {
      const int64_t chunks = (w.keys - w.key_begin + kChunk - 1) / kChunk;
      const int64_t parts = std::min((wanted + have - 1) / have, chunks / kMinSplitChunks);
      if (w.token_end - w.token_begin != 1 || parts < 2) {
        items.push_back(w);
        continue;
      }
      p.splits.push_back({w, p.partial_floats, parts});
      for (int64_t i = 0; i < parts; ++i) {
        WorkItem part = w;
        part.key_begin = w.key_begin + chunks * i / parts * kChunk;
        part.keys = std::min(w.keys, w.key_begin + chunks * (i + 1) / parts * kChunk);
        part.cost = L.group * (part.keys - part.key_begin);
        part.partial = p.partial_floats;
        p.partial_floats += partial_floats(L);
        items.push_back(part);
      }
    }
    p.items = std::move(items);
  }
  std::stable_sort(p.items.begin(), p.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return p;
}

}  // namespace

void paged_attention(Tensor out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables,
                     Tensor seq_lens, Tensor query_start_loc, double scale, int64_t window, double softcap,
                     bool batch_invariant) {
  const ScalarType dtype = query.scalar_type();
  const bool int8_cache = key_cache.scalar_type() == ScalarType::Char;
  check_rows(query, 3, "query");
  check_rows(out, 3, "out");
  check_cpu_dtype(out, dtype, "out");
  check_cpu_dtype(key_cache, int8_cache ? ScalarType::Char : dtype, "key_cache");
  check_cpu_dtype(value_cache, key_cache.scalar_type(), "value_cache");
  TANDEM_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV cache must be contiguous");
  check_cpu_dtype(block_tables, ScalarType::Int, "block_tables");
  check_cpu_dtype(seq_lens, ScalarType::Int, "seq_lens");
  check_cpu_dtype(query_start_loc, ScalarType::Int, "query_start_loc");
  TANDEM_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "block_tables must be [B, max_blocks]");
  TANDEM_CHECK(seq_lens.is_contiguous() && query_start_loc.is_contiguous(), "seq_lens / query_start_loc must be contiguous");
  const int64_t num_reqs = seq_lens.size(0);
  TANDEM_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_tables.size(0) >= num_reqs,
               "query_start_loc must be [B + 1] and block_tables [B, ...]");

  Layout L;
  L.num_heads = query.size(1);
  L.num_kv_heads = key_cache.size(1);
  L.block_size = key_cache.size(2);
  L.head_dim = query.size(2);
  L.row_stride = key_cache.stride(2);
  L.key_align = int8_cache ? kKeyGroup : 1;
  TANDEM_CHECK(key_cache.size(3) == L.head_dim + (int8_cache ? kKvScaleBytes : 0) && L.num_heads % L.num_kv_heads == 0,
               "query heads do not fit the cache");
  TANDEM_CHECK(!int8_cache || (L.block_size % kKeyGroup == 0 && L.head_dim % 4 == 0 && L.head_dim <= kMaxHeadDim),
               "an int8 cache needs block_size a multiple of 16 and head_dim of 4 (at most 512)");
  TANDEM_CHECK(same_shape(key_cache, value_cache), "the key and value caches differ in shape");
  L.group = L.num_heads / L.num_kv_heads;
  L.q_stride_t = query.stride(0);
  L.q_stride_h = query.stride(1);
  L.o_stride_t = out.stride(0);
  L.o_stride_h = out.stride(1);
  L.cache_stride_block = key_cache.stride(0);
  L.cache_stride_head = key_cache.stride(1);
  L.block_tables = ptr<int32_t>(block_tables);
  L.block_table_stride = block_tables.stride(0);
  L.seq_lens = ptr<int32_t>(seq_lens);
  L.query_start_loc = ptr<int32_t>(query_start_loc);
  L.scale = float(scale);
  L.window = window > 0 ? window : int64_t(1) << 40;
  L.softcap = float(softcap);
  const int64_t num_tokens = query.size(0), num_real = L.query_start_loc[num_reqs];
  TANDEM_CHECK(num_real <= num_tokens && out.size(0) == num_tokens, "query_start_loc runs past the query rows");

  const Plan work = plan(L, num_reqs, torch::stable::get_num_threads(), batch_invariant);
  std::vector<float> partials(work.partial_floats);

  auto run_items = [&](auto query_tag, auto cache_tag) {
    using scalar_t = decltype(query_tag);
    using cache_t = decltype(cache_tag);
    const scalar_t* q = ptr<scalar_t>(query);
    const cache_t* kc = ptr<cache_t>(key_cache);
    const cache_t* vc = ptr<cache_t>(value_cache);
    scalar_t* o = ptr<scalar_t>(out);
    auto kernel = L.head_dim == 64    ? &attend<scalar_t, cache_t, 64>
                  : L.head_dim == 128 ? &attend<scalar_t, cache_t, 128>
                                      : &attend<scalar_t, cache_t, 0>;
    auto merge = L.head_dim == 64    ? &merge_splits<scalar_t, cache_t, 64>
                 : L.head_dim == 128 ? &merge_splits<scalar_t, cache_t, 128>
                                     : &merge_splits<scalar_t, cache_t, 0>;
    const std::vector<WorkItem>& items = work.items;
    const int64_t num_items = items.size();
    std::atomic<int64_t> claimed{0};
    auto run = [&](int64_t, int64_t) {  // claims one item ahead, so its first chunk is prefetched
      thread_local Scratch scratch;
      for (int64_t i = claimed.fetch_add(1); i < num_items;) {
        const int64_t next = claimed.fetch_add(1);
        kernel(L, items[i], next < num_items ? &items[next] : nullptr, q, kc, vc, o, partials.data(), scratch);
        i = next;
      }
    };
    const int64_t threads = work.work < kSerialWork ? 1 : std::min<int64_t>(torch::stable::get_num_threads(), num_items);
    if (threads <= 1) {
      run(0, 1);
    } else {
      torch::stable::parallel_for(0, threads, 1, run);
    }
    for (const Split& split : work.splits) merge(L, split.whole, partials.data() + split.first_partial, split.count, o);
    for (int64_t t = num_real; t < num_tokens; ++t) {  // padding rows: zeros, never read
      for (int64_t h = 0; h < L.num_heads; ++h) {
        scalar_t* dst = o + t * L.o_stride_t + h * L.o_stride_h;
        std::memset(dst, 0, L.head_dim * sizeof(scalar_t));
      }
    }
  };
  dispatch_float_bf16(query, [&](auto tag) {
    if (int8_cache) run_items(tag, int8_t{});
    else run_items(tag, tag);
  });
}

// key/value [T, Hkv, D] (rows may be strided) into caches at slot_mapping[t]; slot -1 skips. A float cache
// takes the rows as they are (key in its dtype), an int8 cache their codes and scales (quantize_kv_token).
void write_kv_cache(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, Tensor slot_mapping) {
  const bool int8_cache = key_cache.scalar_type() == ScalarType::Char;
  const ScalarType dtype = int8_cache ? key.scalar_type() : key_cache.scalar_type();
  check_rows(key, 3, "key");
  check_rows(value, 3, "value");
  check_cpu_dtype(key, dtype, "key");
  check_cpu_dtype(value, dtype, "value");
  check_cpu_dtype(value_cache, key_cache.scalar_type(), "value_cache");
  check_cpu_dtype(slot_mapping, ScalarType::Long, "slot_mapping");
  TANDEM_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV cache must be contiguous");
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = key_cache.size(2);
  const int64_t num_slots = key_cache.size(0) * block_size;
  TANDEM_CHECK(slot_mapping.numel() == num_tokens && slot_mapping.is_contiguous(), "slot_mapping must be [T]");
  TANDEM_CHECK(key_cache.size(1) == num_kv_heads && key_cache.size(3) == head_dim + (int8_cache ? kKvScaleBytes : 0),
               "key does not fit the cache");
  TANDEM_CHECK(!int8_cache || (block_size % kKeyGroup == 0 && head_dim % 4 == 0 && head_dim <= kMaxHeadDim),
               "an int8 cache needs block_size a multiple of 16 and head_dim of 4 (at most 512)");
  TANDEM_CHECK(same_shape(key_cache, value_cache), "the key and value caches differ in shape");
  const int64_t* slots = ptr<int64_t>(slot_mapping);
  const int64_t cache_stride_block = key_cache.stride(0), cache_stride_head = key_cache.stride(1);
  const int64_t row_stride = key_cache.stride(2);
  const int64_t key_stride_t = key.stride(0), key_stride_h = key.stride(1);
  const int64_t value_stride_t = value.stride(0), value_stride_h = value.stride(1);
  dispatch_float_bf16(key, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* k = ptr<scalar_t>(key);
    const scalar_t* v = ptr<scalar_t>(value);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      TANDEM_CHECK(slot < num_slots, "slot ", slot, " is outside the cache (", num_slots, " slots)");
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = block * cache_stride_block + h * cache_stride_head + offset * row_stride;
        const scalar_t* k_row = k + t * key_stride_t + h * key_stride_h;
        const scalar_t* v_row = v + t * value_stride_t + h * value_stride_h;
        if (int8_cache) {
          const int64_t slab = block * cache_stride_block + h * cache_stride_head;
          quantize_kv_token<true>(k_row, head_dim, ptr<int8_t>(key_cache) + slab, offset, block_size);
          quantize_kv_token<false>(v_row, head_dim, ptr<int8_t>(value_cache) + slab, offset, block_size);
        } else {
          std::memcpy(ptr<scalar_t>(key_cache) + dst, k_row, head_dim * sizeof(scalar_t));
          std::memcpy(ptr<scalar_t>(value_cache) + dst, v_row, head_dim * sizeof(scalar_t));
        }
      }
    }
  });
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int window, "
      "float softcap, bool batch_invariant=False) -> ()");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("paged_attention", TORCH_BOX(&tandem::paged_attention));
  m.impl("write_kv_cache", TORCH_BOX(&tandem::write_kv_cache));
}
