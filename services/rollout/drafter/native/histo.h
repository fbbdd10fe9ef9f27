/* The compiled history drafter's flat C interface (loaded with ctypes by
 * services/rollout/drafter/compiled.py). C++17 inside; nothing but C types here, so one
 * shared library serves every Python version.
 *
 * Conventions: every function that can fail returns 0 on success and a negative code
 * otherwise (RHD_EINVAL: bad argument, RHD_ENOMEM: out of memory, RHD_EINTERNAL: a bug);
 * rhd_last_error() then says why. Requests are integer slots in [0, max_slots); prompts
 * are integer handles chosen by the caller. Token ids are int32 in [0, 2^31 - 1).
 */
#ifndef RHYMERL_HISTO_H
#define RHYMERL_HISTO_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RHD_ABI_VERSION 6
#define RHD_EINVAL (-1)
#define RHD_ENOMEM (-2)
#define RHD_EINTERNAL (-3)

/* Integer settings, in this order (RHD_CFG_I_COUNT of them). */
enum {
  RHD_USE_HISTORY, RHD_USE_SIBLINGS, RHD_USE_PROMPT, RHD_USE_GLOBAL,
  RHD_MAX_TOKENS_PER_PROMPT, RHD_HISTORY_BUDGET, RHD_GLOBAL_MAX_TOKENS, RHD_MIN_MATCH_LEN,
  RHD_MAX_DRAFT_LEN, RHD_NEUMAIER_SUM, RHD_MAX_SLOTS, RHD_CFG_I_COUNT
};
/* Float settings, in this order (RHD_CFG_D_COUNT of them). */
enum {
  RHD_SIBLING_WEIGHT, RHD_PROMPT_WEIGHT, RHD_SMOOTHING, RHD_BACKOFF_WEIGHT, RHD_MATCH_LEN_PRIOR,
  RHD_GLOBAL_MATCH_LEN_PRIOR, RHD_CFG_D_COUNT
};
/* The live statistics block the drafter keeps up to date (doubles). */
enum {
  RHD_STAT_DRAFT_PER_SEQ, RHD_STAT_GAIN_PER_SEQ, RHD_STAT_NUM_ASKED, RHD_STAT_NUM_EMPTY,
  RHD_STAT_NUM_DRAFT_TOKENS, RHD_STAT_NUM_ACCEPTED, RHD_STAT_COUNT
};

int rhd_abi_version(void);
/* A new drafter; NULL if the settings are invalid or memory is short. `stats` (RHD_STAT_COUNT
 * doubles, owned by the caller, kept alive as long as the drafter) is written after each call. */
void *rhd_create(const int64_t *cfg_i, int32_t num_i, const double *cfg_d, int32_t num_d, double *stats);
void rhd_destroy(void *h);
const char *rhd_last_error(void *h);

/* One prompt's responses from earlier epochs: tokens[offsets[r]:offsets[r+1]] per response,
 * its epoch age and its weight (history_weight * decay^age * reward factor). */
int rhd_load_history(void *h, int64_t prompt, const int32_t *tokens, const int64_t *offsets, int32_t num,
                     const int32_t *ages, const double *weights);
int rhd_add_global(void *h, const int32_t *tokens, const int64_t *offsets, int32_t num);
int rhd_has_prompt(void *h, int64_t prompt); /* 1, 0, or < 0 */
/* 1 when the prompt's index was freed, 0 when it will be with its last request. */
int rhd_release_prompt(void *h, int64_t prompt);

int rhd_start(void *h, int32_t slot, int64_t prompt, const int32_t *prompt_tokens, int64_t num_prompt,
              const int32_t *generated, int64_t num_generated);
/* 1 when the request's prompt index was freed with it (released and no request left). */
int rhd_stop(void *h, int32_t slot);
int rhd_set_stops(void *h, int32_t slot, const int32_t *stops, int32_t num);
/* rhd_set_stops of `n` slots in one call: slot slots[i]'s stop tokens are
 * stops[offsets[i]:offsets[i+1]]. All validated before any is set. */
int rhd_set_stops_many(void *h, int32_t n, const int32_t *slots, const int64_t *offsets, const int32_t *stops);
/* A step's commits, one row per request, applied in order (all validated before any is):
 * drafts[i] > 0: record_acceptance(drafts[i], accepted[i]); -1: record_tree_acceptance of a
 * path of accepted[i] nodes; 0: none. Then counts[i] >= 0: add_tokens of the next counts[i]
 * entries of `tokens` (back to back); -1: no add_tokens. */
int rhd_commit(void *h, int32_t n, const int32_t *slots, const int32_t *drafts, const int32_t *accepted,
               const int32_t *counts, const int32_t *tokens, int64_t num_tokens);
/* rhd_commit with its arguments read from a block bound once (int64 words: n, the addresses
 * of slots, drafts, accepted, counts and tokens, num_tokens), so that the call converts one
 * argument instead of eight (ctypes: about 0.7 µs a call). */
int rhd_bind_commit(void *h, const int64_t *block);
int rhd_commit_bound(void *h);
/* Drafts for `n` slots: out_tokens gets the drafts back to back (capacity n * max_draft_len),
 * out_gains their gains, out_lens each draft's length. budget < 0: no limit. */
int rhd_propose(void *h, int32_t n, const int32_t *slots, const int64_t *max_lens, int64_t budget, double min_gain,
                int32_t *out_tokens, double *out_gains, int32_t *out_lens);

/* The batched step (what CompiledDrafter calls once per engine step): buffers bound once,
 * then each rhd_step reads its inputs from `params` (int64 words: n, budget (INT64_MIN: no
 * limit; < 0: none), min_gain (a double's bits), num_seqs (0: n) for the cost threshold, the
 * n slots, the n max_lens) and writes the drafts back to back to out_tokens/out_gains
 * (capacity * max_draft_len each) and their offsets to out_offsets (n + 1 entries). */
int rhd_bind(void *h, int64_t *params, int32_t capacity, int32_t *out_tokens, double *out_gains,
             int32_t *out_offsets);
int rhd_step(void *h);
/* Draft trees (HistoDrafter.propose_trees's tree branch; the caller picks trees or linear
 * drafts): buffers for `capacity` trees of at most `max_nodes` nodes each, bound once, then
 * each rhd_step_trees reads the params block bound by rhd_bind (min_gain: the trees' floor,
 * tree_min_gain) and writes the trees back to back, best first (tokens, gains, parents:
 * an earlier node's index in the tree, -1 the root) and their offsets (n + 1 entries).
 * A tree has at most min(max_nodes, max_draft_len * width) nodes, `width` children per node. */
int rhd_bind_trees(void *h, int32_t capacity, int64_t max_nodes, int32_t *out_tokens, double *out_gains,
                   int32_t *out_parents, int32_t *out_offsets);
int rhd_step_trees(void *h, int64_t max_nodes, int64_t width);
/* The engine's cost curve (num points, increasing token counts, positive ms), from which
 * rhd_step raises min_gain to budget.gain_threshold at the step's batch size; num = 0:
 * no curve (min_gain as given). */
int rhd_set_curve(void *h, const double *num_tokens, const double *ms, int32_t num);
/* budget.gain_threshold on the curve set (what rhd_step applies), for given statistics. */
int rhd_gain_threshold(void *h, int64_t num_seqs, double draft_per_seq, double gain_per_seq, double *out);

int64_t rhd_memory_tokens(void *h, int64_t prompt);
int64_t rhd_memory_bytes(void *h, int64_t prompt);
int64_t rhd_global_tokens(void *h);
int64_t rhd_global_bytes(void *h);
/* num_prompts, memory_tokens over all prompts. */
int rhd_prompt_totals(void *h, int64_t *out);

#ifdef __cplusplus
}
#endif
#endif
