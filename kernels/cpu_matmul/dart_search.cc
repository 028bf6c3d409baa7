// DART's tree search (dart_jax/tree/dart_search.py, `search_candidates`) and the
// context N-gram's inserts (dart_jax/ngram/context.py) as XLA FFI calls on CPU.
//
//   DartSearchTree: from each sequence's top-k candidates of every draft level
// (target ids and log(p + eps)), its context window, the corpus N-gram's hash
// tables (`NGramTable`) and its context N-gram (`ContextNGram`), the beam
// search's kept nodes as a `Tree`: tokens, parents, depths, scores, the
// ancestor mask and the leaf paths.
//
//   DartContextInsert: `ContextNGram.add`'s inserts into each row's hash table
// (see ContextInsert below).
//
// Why: XLA:CPU runs the search as a scan over levels plus ~15 small ops per
// level (hashed gathers, top-k, selects), each a thunk with its own dispatch:
// with the inserts, ~1.0-1.3 ms of a ~25 ms fused DART round on the 2-core Zen
// 3. Here the same work is a few thousand scalar operations (~0.2 ms, mostly
// the N-gram tables' hashed reads from memory).
//
// Semantics are the JAX search's, rule for rule (see dart_search.py for the
// tie-breaking): level candidates shared by the beam plus each member's
// injected copy prediction, the N-gram term from the longest matching suffix
// (corpus, mixed with the context's estimate where it matches), the EOS-last
// beam cut, the final top-N by score then record, BFS order. Float work is
// float32 with the same operation order; std::log / std::exp may differ from
// XLA's in the last bit, so scores agree to ~2e-6 and a near-tie at a cut can
// fall either way (the tests compare against the reference with margins).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

uint32_t HashPair(uint32_t node, uint32_t token) {
  uint32_t h = (node * 0x9E3779B1u) ^ (token + 0x7F4A7C15u);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// The corpus N-gram: `NGramTable`'s arrays and static layout.
struct CorpusTable {
  const int32_t* keys = nullptr;  // [K, 2] (parent node, token)
  const int32_t* counts = nullptr;  // [K]
  const int32_t* bucket_start = nullptr;
  std::vector<int64_t> offset, size, window;  // per depth 1..order
  int width = 0;  // order - 1 suffix nodes per beam member (0 = no table)

  struct Child {
    int32_t node;
    int32_t count;
  };

  // `NGramTable.child`: the child of `node` (depth - 1) with `token`.
  Child Lookup(int depth, int32_t node, int32_t token) const {
    if (node < 0 || depth > static_cast<int>(size.size())) return {-1, 0};
    const uint32_t bucket = HashPair(static_cast<uint32_t>(node), static_cast<uint32_t>(token)) %
                            static_cast<uint32_t>(size[depth - 1]);
    const int64_t start = bucket_start[offset[depth - 1] + bucket];
    for (int64_t i = 0; i < window[depth - 1]; ++i) {
      const int32_t* key = keys + 2 * (start + i);
      if (key[0] == node && key[1] == token) {
        return {static_cast<int32_t>(start + i), counts[start + i]};
      }
    }
    return {-1, 0};
  }
};

constexpr int32_t kTotal = -1;  // context.TOTAL
constexpr int32_t kLast = -2;  // context.LAST
constexpr uint32_t kContextSeed = 0x2545F491u;

// One sequence's context N-gram (`ContextNGram`, one row) and its rule.
struct ContextTable {
  const uint32_t* keys = nullptr;  // [S]
  const int32_t* values = nullptr;  // [S]
  uint32_t mask = 0;
  int probes = 0, width = 0, min_order = 0;
  float weight = 0.0f, draft_weight = 0.0f;
  bool inject = false;

  static uint32_t EntryKey(uint32_t context_hash, int32_t next) {
    const uint32_t key = HashPair(context_hash, static_cast<uint32_t>(next));
    return key == 0 ? 1u : key;
  }

  int32_t Find(uint32_t query) const {
    int32_t total = 0;  // `lookup` sums the window's matches (keys are unique)
    for (int p = 0; p < probes; ++p) {
      const uint32_t slot = (query + static_cast<uint32_t>(p)) & mask;
      if (keys[slot] == query) total += values[slot];
    }
    return total;
  }

  // `suffix_hashes`: hashes[m - 1] of the last m tokens, ok[m - 1] if all real.
  void SuffixHashes(const int32_t* tokens, const uint8_t* valid, uint32_t* hashes,
                    bool* ok) const {
    uint32_t h = kContextSeed;
    bool all = true;
    for (int i = width - 1, m = 0; i >= 0; --i, ++m) {
      h = HashPair(h, static_cast<uint32_t>(tokens[i]));
      all = all && valid[i];
      hashes[m] = h;
      ok[m] = all;
    }
  }

  // `predict`: the token after the latest occurrence of the longest stored suffix.
  int32_t Predict(const uint32_t* hashes, const bool* ok) const {
    int32_t token = -1;
    for (int m = min_order - 1; m <= width; ++m) {
      const int32_t last = Find(EntryKey(hashes[m - 1], kLast));
      if (ok[m - 1] && last > 0) token = last - 1;
    }
    return token;
  }

  // `probability`: count(ctx, t) / count(ctx) for the longest matching ctx.
  void Probability(const uint32_t* hashes, const bool* ok, int32_t token, float* prob,
                   int32_t* matched) const {
    *prob = 0.0f;
    *matched = 0;
    for (int m = width; m >= min_order - 1; --m) {
      if (!ok[m - 1]) continue;
      const int32_t num = Find(EntryKey(hashes[m - 1], token));
      if (num <= 0) continue;
      const float total = static_cast<float>(Find(EntryKey(hashes[m - 1], kTotal)));
      *prob = static_cast<float>(num) / std::max(total, 1.0f);
      *matched = m + 1;
      return;
    }
  }
};

struct SearchConfig {
  int levels = 0, topk = 0, beam_width = 0, keep_count = 0;
  int32_t eos_id = -1;  // -1: no EOS rule
  float eps = 0.0f, ngram_weight = 0.0f;
  bool use_table = false, constant_ngram_term = false, use_context = false;
  const float* level_weights = nullptr;
  const float* logit_weights = nullptr;
};

// Indices of the `count` best entries, by value descending then index
// ascending (lax.top_k's order).
void TopK(const std::vector<float>& values, int count, std::vector<int32_t>& out) {
  out.resize(values.size());
  std::iota(out.begin(), out.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  };
  std::partial_sort(out.begin(), out.begin() + count, out.end(), better);
  out.resize(count);
}

struct Member {
  float score;
  int32_t record;
  std::vector<int32_t> nodes;  // corpus suffix nodes [width]
  std::vector<int32_t> context;  // last context-width tokens
  std::vector<uint8_t> valid;
};

struct Records {
  std::vector<int32_t> tokens, parents, levels;
  std::vector<float> scores;
};

// One sequence's search; writes the tree's node lists (BFS order).
void SearchOne(const SearchConfig& cfg, const CorpusTable& corpus, const ContextTable& ctx,
               const int32_t* tokens, const float* log_probs, const int32_t* context,
               int64_t context_size, int32_t context_len, int32_t* node_tokens,
               int32_t* node_parents, int32_t* node_depth, float* node_scores) {
  const int k = cfg.topk;
  const int c = static_cast<int>(context_size);
  const int real_len = std::clamp<int>(context_len, 1, c);
  const bool inject = cfg.use_context && ctx.inject;
  const int children = inject ? k + 1 : k;
  const int width = cfg.use_table ? corpus.width : 0;
  const int cw = cfg.use_context ? ctx.width : 0;
  const float eps = cfg.eps;
  const float log_eps = std::log(eps);

  std::vector<Member> beam(1);
  Member& first = beam[0];
  first.score = 0.0f;
  first.record = -1;
  if (width > 0) {  // `suffix_nodes` of the window of the last `width` tokens
    const int window_len = std::min(real_len, width);
    first.nodes.assign(width, -1);
    for (int m = 1; m <= width; ++m) {
      if (m > window_len) continue;  // also covers m > c (padding)
      int32_t node = 0;
      for (int depth = 1, i = c - m; i < c; ++depth, ++i) {
        node = corpus.Lookup(depth, node, context[i]).node;
      }
      first.nodes[m - 1] = node;
    }
  }
  for (int i = c - cw; i < c; ++i) {
    first.context.push_back(context[i]);
    first.valid.push_back(i >= c - real_len);
  }

  Records rec;
  std::vector<int32_t> cand(children);
  std::vector<float> draft(children);
  std::vector<uint32_t> hashes(std::max(cw, 1));
  std::vector<uint8_t> ok_bytes(std::max(cw, 1));
  bool ok[64];
  std::vector<float> child_scores;
  std::vector<int32_t> child_tokens, next_nodes, keep, best_other, best_eos;
  std::vector<float> masked;
  std::vector<CorpusTable::Child> kids(std::max(width, 1));
  for (int level = 0; level < cfg.levels; ++level) {
    const bool with_ngram = level > 0;
    const bool cut = level + 1 < cfg.levels;
    const int size = static_cast<int>(beam.size());
    const int32_t* level_tokens = tokens + level * k;
    const float* level_log_probs = log_probs + level * k;
    const float level_weight = cfg.level_weights[level];
    const float logit_weight = cfg.logit_weights[level];
    child_scores.assign(size * children, 0.0f);
    child_tokens.assign(size * children, 0);
    next_nodes.assign(static_cast<size_t>(size) * children * width, -1);
    for (int b = 0; b < size; ++b) {
      const Member& member = beam[b];
      std::copy(level_tokens, level_tokens + k, cand.begin());
      std::copy(level_log_probs, level_log_probs + k, draft.begin());
      bool fresh = false;
      if (cfg.use_context) {
        ctx.SuffixHashes(member.context.data(), member.valid.data(), hashes.data(), ok);
        if (inject) {
          const int32_t copy = ctx.Predict(hashes.data(), ok);
          fresh = copy >= 0 && std::find(cand.begin(), cand.begin() + k, copy) ==
                                   cand.begin() + k;
          cand[k] = fresh ? copy : level_tokens[0];
          draft[k] = log_eps;
        }
      }
      for (int j = 0; j < children; ++j) {
        const int32_t token = cand[j];
        float p_ngram = 0.0f;
        bool have_ngram = false;
        if (cfg.use_table && (with_ngram || cut)) {  // `NGramTable.step`
          have_ngram = true;
          if (width > 0) {
            int32_t* next = next_nodes.data() + (static_cast<size_t>(b) * children + j) * width;
            for (int m = 1; m <= width; ++m) {
              kids[m - 1] = corpus.Lookup(m + 1, member.nodes[m - 1], token);
            }
            int32_t matched = 0;
            for (int m = width; m >= 1 && matched == 0; --m) {
              const CorpusTable::Child kid = kids[m - 1];
              if (kid.node < 0) continue;
              const float parent_count =
                  static_cast<float>(corpus.counts[std::max(member.nodes[m - 1], 0)]);
              const float inverse = 1.0f / parent_count;
              p_ngram = kid.count == 0 ? 0.0f : static_cast<float>(kid.count) * inverse;
              matched = m;
            }
            next[0] = corpus.Lookup(1, 0, token).node;
            for (int m = 1; m < width; ++m) next[m] = kids[m - 1].node;
          }
        }
        float p_context = 0.0f;
        int32_t context_matched = 0;
        if (cfg.use_context && (with_ngram || ctx.draft_weight > 0.0f)) {
          ctx.Probability(hashes.data(), ok, token, &p_context, &context_matched);
        }
        float draft_log_prob = draft[j];
        if (cfg.use_context && ctx.draft_weight > 0.0f) {
          const float p_draft = std::max(std::exp(draft_log_prob) - eps, 0.0f);
          const float from_context = ctx.draft_weight * (context_matched > 0 ? p_context : 0.0f);
          draft_log_prob = std::log(std::max(p_draft, from_context) + eps);
        }
        float inner = draft_log_prob * logit_weight;
        if (cfg.use_context && with_ngram) {
          p_ngram = context_matched > 0
                        ? ctx.weight * p_context + (1.0f - ctx.weight) * p_ngram
                        : p_ngram;
          have_ngram = true;
        }
        if (have_ngram && with_ngram) {
          inner = inner + std::log(p_ngram + eps) * cfg.ngram_weight;
        } else if (cfg.constant_ngram_term && with_ngram) {
          inner = inner + log_eps * cfg.ngram_weight;
        }
        float score = member.score + level_weight * inner;
        if (j == k && !fresh) score = -std::numeric_limits<float>::infinity();
        child_scores[b * children + j] = score;
        child_tokens[b * children + j] = token;
        rec.tokens.push_back(token);
        rec.parents.push_back(member.record);
        rec.scores.push_back(score);
        rec.levels.push_back(level);
      }
    }
    if (!cut) break;
    // The beam cut (`_beam_cut`): non-EOS children by score, then EOS children.
    const int keep_width = std::min(cfg.beam_width, size * k);
    const int offset = static_cast<int>(rec.tokens.size()) - size * children;
    if (cfg.eos_id < 0) {
      TopK(child_scores, keep_width, keep);
    } else {
      const float neg_inf = -std::numeric_limits<float>::infinity();
      int num_other = 0;
      masked.resize(child_scores.size());
      for (size_t i = 0; i < child_scores.size(); ++i) {
        const bool is_eos = child_tokens[i] == cfg.eos_id;
        num_other += !is_eos;
        masked[i] = is_eos ? neg_inf : child_scores[i];
      }
      TopK(masked, keep_width, best_other);
      for (size_t i = 0; i < child_scores.size(); ++i) {
        masked[i] = child_tokens[i] == cfg.eos_id ? child_scores[i] : neg_inf;
      }
      TopK(masked, keep_width, best_eos);
      keep.resize(keep_width);
      for (int slot = 0; slot < keep_width; ++slot) {
        keep[slot] = slot < num_other
                         ? best_other[slot]
                         : best_eos[std::clamp(slot - num_other, 0, keep_width - 1)];
      }
    }
    std::vector<Member> next_beam(keep_width);
    for (int i = 0; i < keep_width; ++i) {
      const int32_t flat = keep[i];
      const Member& parent = beam[flat / children];
      Member& member = next_beam[i];
      member.score = child_scores[flat];
      member.record = offset + flat;
      member.nodes.assign(next_nodes.begin() + static_cast<size_t>(flat) * width,
                          next_nodes.begin() + static_cast<size_t>(flat + 1) * width);
      if (cw > 0) {
        member.context.assign(parent.context.begin() + 1, parent.context.end());
        member.context.push_back(child_tokens[flat]);
        member.valid.assign(parent.valid.begin() + 1, parent.valid.end());
        member.valid.push_back(1);
      }
    }
    beam.swap(next_beam);
  }

  // The final cut: the best keep_count records (ties: lower record), BFS order.
  std::vector<int32_t> ranked;
  TopK(rec.scores, cfg.keep_count, ranked);
  std::vector<int32_t> bfs(ranked);
  std::stable_sort(bfs.begin(), bfs.end(),
                   [&](int32_t a, int32_t b) { return rec.levels[a] < rec.levels[b]; });
  std::vector<int32_t> node_of_record(rec.scores.size(), 0);
  for (int i = 0; i < cfg.keep_count; ++i) node_of_record[bfs[i]] = i + 1;
  node_tokens[0] = context[c - 1];
  node_parents[0] = -1;
  node_depth[0] = 0;
  node_scores[0] = 0.0f;
  for (int i = 0; i < cfg.keep_count; ++i) {
    const int32_t r = bfs[i];
    node_tokens[i + 1] = rec.tokens[r];
    node_parents[i + 1] = rec.parents[r] < 0 ? 0 : node_of_record[rec.parents[r]];
    node_depth[i + 1] = rec.levels[r] + 1;
    node_scores[i + 1] = rec.scores[r];
  }
}

// `build_tree`'s mask, leaf paths and leaf count from the node lists.
void BuildTree(int num_nodes, int size, int max_depth, const int32_t* parents,
               const int32_t* depth, bool* mask, int32_t* paths, int32_t* num_leaves) {
  std::fill(mask, mask + size * size, false);
  for (int i = 0; i < size; ++i) {
    for (int j = i; j >= 0; j = parents[j]) mask[i * size + j] = true;
  }
  std::vector<bool> has_child(size, false);
  for (int i = 1; i <= num_nodes; ++i) has_child[parents[i]] = true;
  const int columns = max_depth + 1;
  std::fill(paths, paths + (size - 1) * columns, -1);
  int leaves = 0;
  for (int i = 1; i <= num_nodes; ++i) {
    if (has_child[i]) continue;
    for (int j = i; j >= 0; j = parents[j]) paths[leaves * columns + depth[j]] = j;
    ++leaves;
  }
  *num_leaves = leaves;
}

ffi::Error DartSearchTree(
    ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::F32> log_probs,
    ffi::Buffer<ffi::S32> context, ffi::Buffer<ffi::S32> context_len,
    ffi::Buffer<ffi::S32> table_keys, ffi::Buffer<ffi::S32> table_counts,
    ffi::Buffer<ffi::S32> bucket_start, ffi::Buffer<ffi::U32> context_keys,
    ffi::Buffer<ffi::S32> context_values, ffi::Buffer<ffi::F32> weights,
    ffi::ResultBuffer<ffi::S32> out_tokens, ffi::ResultBuffer<ffi::S32> out_parents,
    ffi::ResultBuffer<ffi::S32> out_depth, ffi::ResultBuffer<ffi::F32> out_scores,
    ffi::ResultBuffer<ffi::PRED> out_mask, ffi::ResultBuffer<ffi::S32> out_paths,
    ffi::ResultBuffer<ffi::S32> out_leaves, ffi::Span<const int64_t> table_layout,
    int64_t beam_width, int64_t keep_count, int64_t eos_id, float eps, float ngram_weight,
    int64_t use_table, int64_t table_width, int64_t constant_ngram_term, int64_t context_width,
    int64_t context_min_order, float context_weight, float context_draft_weight,
    int64_t context_inject, int64_t context_probes) {
  auto tdims = tokens.dimensions();
  auto cdims = context.dimensions();
  auto kdims = context_keys.dimensions();
  auto ldims = log_probs.dimensions();
  if (tdims.size() != 3 || ldims.size() != 3 || ldims[0] != tdims[0] || ldims[1] != tdims[1] ||
      ldims[2] != tdims[2] || cdims.size() != 2 ||
      cdims[0] != tdims[0] || cdims[1] < 1 || kdims.size() != 2 || kdims[0] != tdims[0] ||
      weights.element_count() != 2 * tdims[1] || table_layout.size() % 3 != 0 ||
      context_width > 64) {
    return ffi::Error::InvalidArgument("dart_search_tree: inconsistent shapes");
  }
  const int64_t batch = tdims[0], levels = tdims[1], topk = tdims[2];
  const int64_t size = out_tokens->dimensions()[1];
  if (keep_count + 1 > size || (kdims[1] & (kdims[1] - 1)) != 0) {
    return ffi::Error::InvalidArgument("dart_search_tree: bad node budget or table size");
  }
  SearchConfig cfg;
  cfg.levels = static_cast<int>(levels);
  cfg.topk = static_cast<int>(topk);
  cfg.beam_width = static_cast<int>(beam_width);
  cfg.keep_count = static_cast<int>(keep_count);
  cfg.eos_id = static_cast<int32_t>(eos_id);
  cfg.eps = eps;
  cfg.ngram_weight = ngram_weight;
  cfg.use_table = use_table != 0;
  cfg.constant_ngram_term = constant_ngram_term != 0;
  cfg.use_context = context_width > 0;
  cfg.level_weights = weights.typed_data();
  cfg.logit_weights = weights.typed_data() + levels;
  CorpusTable corpus;
  corpus.keys = table_keys.typed_data();
  corpus.counts = table_counts.typed_data();
  corpus.bucket_start = bucket_start.typed_data();
  const size_t depths = table_layout.size() / 3;
  for (size_t d = 0; d < depths; ++d) {
    corpus.offset.push_back(table_layout[d]);
    corpus.size.push_back(table_layout[depths + d]);
    corpus.window.push_back(table_layout[2 * depths + d]);
  }
  corpus.width = cfg.use_table ? static_cast<int>(table_width) : 0;
  ContextTable ctx;
  ctx.mask = static_cast<uint32_t>(kdims[1] - 1);
  ctx.probes = static_cast<int>(context_probes);
  ctx.width = static_cast<int>(context_width);
  ctx.min_order = static_cast<int>(context_min_order);
  ctx.weight = context_weight;
  ctx.draft_weight = context_draft_weight;
  ctx.inject = context_inject != 0;
  const int64_t columns = levels + 1;
  for (int64_t b = 0; b < batch; ++b) {
    ctx.keys = context_keys.typed_data() + b * kdims[1];
    ctx.values = context_values.typed_data() + b * kdims[1];
    int32_t* node_tokens = out_tokens->typed_data() + b * size;
    int32_t* node_parents = out_parents->typed_data() + b * size;
    int32_t* node_depth = out_depth->typed_data() + b * size;
    float* node_scores = out_scores->typed_data() + b * size;
    std::fill(node_tokens, node_tokens + size, 0);
    std::fill(node_parents, node_parents + size, -1);
    std::fill(node_depth, node_depth + size, 0);
    std::fill(node_scores, node_scores + size, -std::numeric_limits<float>::infinity());
    SearchOne(cfg, corpus, ctx, tokens.typed_data() + b * levels * topk,
              log_probs.typed_data() + b * levels * topk, context.typed_data() + b * cdims[1],
              cdims[1], context_len.typed_data()[b], node_tokens, node_parents, node_depth,
              node_scores);
    BuildTree(cfg.keep_count, static_cast<int>(size), static_cast<int>(levels), node_parents,
              node_depth, out_mask->typed_data() + b * size * size,
              out_paths->typed_data() + b * (size - 1) * columns,
              out_leaves->typed_data() + b);
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------- context N-gram inserts
// `context._insert_row` for each row of a batch, step for step, so the table
// comes out bit-identical: valid keys sorted (stable), one entry per distinct
// key (its values summed, or the latest one), then claim rounds over the probe
// window: a key finds itself, or claims an empty slot (the largest claimant
// wins), or moves one slot on. XLA:CPU ran this as a sort, cumulative sums and
// a while loop of gathers and scatters, ~0.4 ms a DART round on the Zen 3.
void InsertRow(uint32_t* keys, int32_t* values, int64_t slots, const uint32_t* new_keys,
               const int32_t* new_values, const bool* valid, int64_t n, int probes, bool add) {
  std::vector<uint32_t> masked(n);
  for (int64_t i = 0; i < n; ++i) masked[i] = valid[i] ? new_keys[i] : 0u;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return masked[a] < masked[b]; });
  std::vector<uint32_t> ordered(n);
  std::vector<int32_t> ordered_values(n);
  for (int64_t i = 0; i < n; ++i) {
    ordered[i] = masked[order[i]];
    ordered_values[i] = new_values[order[i]];
  }
  std::vector<uint8_t> is_head(n), placed(n);
  std::vector<int64_t> next_head(n);
  for (int64_t i = 0; i < n; ++i) {
    is_head[i] = ordered[i] != 0 && (i == 0 || ordered[i] != ordered[i - 1]);
    placed[i] = !is_head[i];
  }
  int64_t following = n;
  for (int64_t i = n - 1; i >= 0; --i) {
    next_head[i] = following;
    if (is_head[i]) following = i;
  }
  const uint32_t mask = static_cast<uint32_t>(slots - 1);
  std::vector<int64_t> slot_of(n, 0), slot(n);
  std::vector<uint32_t> current(n);
  for (int probe = 0; probe < probes; ++probe) {
    bool all = true;
    for (int64_t i = 0; i < n && all; ++i) all = placed[i];
    if (all) break;
    for (int64_t i = 0; i < n; ++i) {  // reads before the round's claims
      if (placed[i]) continue;
      slot[i] = (ordered[i] + static_cast<uint32_t>(probe)) & mask;
      current[i] = keys[slot[i]];
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!placed[i] && current[i] == 0) keys[slot[i]] = std::max(keys[slot[i]], ordered[i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (placed[i]) continue;
      const bool found = current[i] == ordered[i];
      const bool won = current[i] == 0 && keys[slot[i]] == ordered[i];
      if (found || won) {
        placed[i] = 1;
        slot_of[i] = slot[i];
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!(placed[i] && is_head[i])) continue;
    if (add) {
      int32_t total = 0;
      for (int64_t j = i; j < next_head[i]; ++j) total += ordered_values[j];
      values[slot_of[i]] += total;
    } else {
      values[slot_of[i]] = ordered_values[std::max<int64_t>(next_head[i] - 1, 0)];
    }
  }
}

ffi::Error ContextInsert(ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::S32> values,
                         ffi::Buffer<ffi::U32> new_keys, ffi::Buffer<ffi::S32> new_values,
                         ffi::Buffer<ffi::PRED> valid, ffi::ResultBuffer<ffi::U32> out_keys,
                         ffi::ResultBuffer<ffi::S32> out_values, int64_t probes, int64_t add) {
  auto kdims = keys.dimensions();
  auto ndims = new_keys.dimensions();
  if (kdims.size() != 2 || ndims.size() != 2 || ndims[0] != kdims[0] ||
      values.element_count() != keys.element_count() ||
      new_values.element_count() != new_keys.element_count() ||
      valid.element_count() != new_keys.element_count() || (kdims[1] & (kdims[1] - 1)) != 0) {
    return ffi::Error::InvalidArgument("context_insert: inconsistent shapes");
  }
  const int64_t rows = kdims[0], slots = kdims[1], n = ndims[1];
  uint32_t* ok = out_keys->typed_data();
  int32_t* ov = out_values->typed_data();
  if (ok != keys.typed_data()) std::copy_n(keys.typed_data(), rows * slots, ok);
  if (ov != values.typed_data()) std::copy_n(values.typed_data(), rows * slots, ov);
  for (int64_t r = 0; r < rows; ++r) {
    InsertRow(ok + r * slots, ov + r * slots, slots, new_keys.typed_data() + r * n,
              new_values.typed_data() + r * n, valid.typed_data() + r * n, n,
              static_cast<int>(probes), add != 0);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DartSearchTreeCpu, DartSearchTree,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tokens [B, L, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // log_probs [B, L, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context [B, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_len [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table keys [K, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table counts [K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // bucket starts
                                  .Arg<ffi::Buffer<ffi::U32>>()  // context keys [B, S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context values [B, S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // level, logit weights [2L]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tokens [B, N+1]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // parents [B, N+1]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // depth [B, N+1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scores [B, N+1]
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // mask [B, N+1, N+1]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // paths [B, N, L+1]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // leaves [B]
                                  .Attr<ffi::Span<const int64_t>>("table_layout")
                                  .Attr<int64_t>("beam_width")
                                  .Attr<int64_t>("keep_count")
                                  .Attr<int64_t>("eos_id")
                                  .Attr<float>("eps")
                                  .Attr<float>("ngram_weight")
                                  .Attr<int64_t>("use_table")
                                  .Attr<int64_t>("table_width")
                                  .Attr<int64_t>("constant_ngram_term")
                                  .Attr<int64_t>("context_width")
                                  .Attr<int64_t>("context_min_order")
                                  .Attr<float>("context_weight")
                                  .Attr<float>("context_draft_weight")
                                  .Attr<int64_t>("context_inject")
                                  .Attr<int64_t>("context_probes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DartContextInsertCpu, ContextInsert,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // keys [B, S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // values [B, S]
                                  .Arg<ffi::Buffer<ffi::U32>>()  // new keys [B, n]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // new values [B, n]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid [B, n]
                                  .Ret<ffi::Buffer<ffi::U32>>()  // keys (aliases keys)
                                  .Ret<ffi::Buffer<ffi::S32>>()  // values (aliases values)
                                  .Attr<int64_t>("probes")
                                  .Attr<int64_t>("add"));
