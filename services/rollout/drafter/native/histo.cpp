// The history drafter's core in C++17: the same suffix automata, sources, walk and budget
// as the Python HistoDrafter (services/rollout/drafter/*.py, the reference), draft for
// draft. Each piece names the Python function it mirrors; where Python's semantics decide
// a draft (a dict's insertion order, a set's iteration order, how sum() rounds) they are
// reproduced on purpose. Not thread-safe: one engine loop drives it.
#include "histo.h"

#include <setjmp.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <new>
#include <queue>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

// Errors without C++ exceptions: the unwinder of a static libgcc needs glibc 2.34+ symbols,
// so this library is built with -fno-exceptions and each C entry point sets a jump buffer.
// A bad argument (found before anything is changed) jumps back with RHD_EINVAL; running out
// of memory anywhere jumps back with RHD_ENOMEM and marks the drafter broken (a half-done
// change is never used again: every later call fails, the caller makes a new drafter).
namespace {
struct Guard {
  jmp_buf env;
  char *error;  // the drafter's message buffer (256 bytes)
  bool *broken;
};
__thread Guard *current = nullptr;

[[noreturn]] void out_of_memory() {
  Guard *g = current;
  if (g == nullptr) abort();  // not inside an entry point: cannot happen
  std::snprintf(g->error, 256, "out of memory: the drafter is unusable now (make a new one)");
  *g->broken = true;
  longjmp(g->env, 1);
}
}  // namespace

// Global allocation inside this library only (hidden, like every symbol not exported):
// malloc, and out_of_memory() instead of throwing std::bad_alloc. Not in the sanitized
// build (RHD_SANITIZE), where the sanitizer's own operators must pair every new and delete.
#ifndef RHD_SANITIZE
void *operator new(size_t n) {
  void *p = malloc(n ? n : 1);
  if (p == nullptr) out_of_memory();
  return p;
}
void *operator new[](size_t n) { return operator new(n); }
void *operator new(size_t n, const std::nothrow_t &) noexcept { return malloc(n ? n : 1); }
void operator delete(void *p) noexcept { free(p); }
void operator delete[](void *p) noexcept { free(p); }
void operator delete(void *p, size_t) noexcept { free(p); }
void operator delete[](void *p, size_t) noexcept { free(p); }
#endif

// What the standard containers call where they would throw: the same.
namespace std {
void __throw_bad_alloc() { out_of_memory(); }
void __throw_bad_array_new_length() { out_of_memory(); }
void __throw_length_error(const char *) { out_of_memory(); }
void __throw_logic_error(const char *) { abort(); }
void __throw_out_of_range(const char *) { abort(); }
void __throw_out_of_range_fmt(const char *, ...) { abort(); }
void __throw_bad_function_call() { abort(); }
}  // namespace std

namespace {

constexpr int32_t START = -1;        // prompt_index.START
constexpr int MAX_PROPAGATION = 64;  // suffix_index.MAX_PROPAGATION
constexpr int64_t REMATCH_TOKENS = 32, KEY_TOKENS = 16;
constexpr size_t MAX_FED = 4096;     // global_index constants
constexpr double EMA = 0.2, DECAY = 0.8;
constexpr size_t LINEAR_EDGES = 8;   // edge lists up to this long are searched linearly
constexpr int32_t MAX_TOKEN = 0x7ffffffe;

// A bad argument: back to the entry point with RHD_EINVAL. Only called before the call has
// changed anything or holds memory.
[[noreturn]] void invalid(const char *fmt, long long a = 0, long long b = 0) {
  Guard *g = current;
  if (g == nullptr) abort();
  std::snprintf(g->error, 256, fmt, a, b);
  longjmp(g->env, 2);
}

// Python's sum() over floats: a running total up to 3.11, Neumaier-compensated from 3.12.
struct PySum {
  bool neumaier;
  double s = 0.0, c = 0.0;
  bool any = false;
  explicit PySum(bool n) : neumaier(n) {}
  void add(double x) {
    if (!any) { s = x; any = true; return; }
    if (!neumaier) { s += x; return; }
    double t = s + x;
    if (std::fabs(s) >= std::fabs(x)) c += (s - t) + x; else c += (x - t) + s;
    s = t;
  }
  double get() const { return (any && c != 0.0 && std::isfinite(c)) ? s + c : s; }
};

// The iteration order of a small CPython set of non-negative ints (hash = value): linear
// probes of 9 when they fit, perturbed otherwise; resized to 32 slots at the 5th key.
struct PySet {
  int32_t table[32];
  bool used[32];
  size_t mask = 7;
  int fill = 0;
  PySet() { std::memset(used, 0, sizeof used); }
  static void insert_clean(int32_t *table, bool *used, size_t mask, int32_t key) {
    size_t perturb = (size_t)key, i = (size_t)key & mask;
    for (;;) {
      if (!used[i]) { used[i] = true; table[i] = key; return; }
      if (i + 9 <= mask)
        for (size_t j = 1; j <= 9; ++j)
          if (!used[i + j]) { used[i + j] = true; table[i + j] = key; return; }
      perturb >>= 5;
      i = (i * 5 + 1 + perturb) & mask;
    }
  }
  void add(int32_t key) {
    size_t perturb = (size_t)key, i = (size_t)key & mask;
    for (;;) {
      size_t probes = (i + 9 <= mask) ? 9 : 0, j = i;
      for (;;) {
        if (!used[j]) {
          used[j] = true; table[j] = key; ++fill;
          if ((size_t)fill * 5 >= mask * 3) resize();
          return;
        }
        if (table[j] == key) return;
        ++j;
        if (probes == 0) break;
        --probes;
      }
      perturb >>= 5;
      i = (i * 5 + 1 + perturb) & mask;
    }
  }
  void resize() {  // only ever from 8 to 32 slots here (at most 6 keys)
    int32_t t[32];
    bool u[32];
    std::memset(u, 0, sizeof u);
    for (size_t k = 0; k <= mask; ++k)
      if (used[k]) insert_clean(t, u, 31, table[k]);
    std::memcpy(table, t, sizeof t);
    std::memcpy(used, u, sizeof u);
    mask = 31;
  }
};

// ---------------------------------------------------------------- suffix_index.SuffixIndex

typedef std::pair<int32_t, int32_t> Item;  // (token, target)

// An edge list's token -> position map past LINEAR_EDGES: open addressing in one array of
// (token, position) pairs (linear probing, Fibonacci hashing, a power of two at most half
// full; its size follows from the list's length: table_size). A lookup reads one or two
// cache lines, where std::unordered_map read its bucket array and then a node of its own
// allocation (its find was a sixth of the core's samples in a perf profile of the replay).
constexpr int32_t NO_TOKEN = INT32_MIN;  // an empty slot (tokens are START = -1 and up)

inline uint32_t table_size(size_t n) {  // slots for an edge list of n > LINEAR_EDGES items
  uint32_t want = (uint32_t)(2 * n - 1);
  return std::max<uint32_t>(32, 1u << (32 - __builtin_clz(want)));
}

inline uint32_t table_slot(int32_t tok, uint32_t size) {  // the top log2(size) bits of tok * 2^32/phi
  return (uint32_t)((uint64_t)((uint32_t)tok * 2654435769u) * size >> 32);
}

struct Edges {  // a dict's edges: insertion order kept, values updated in place
  std::vector<Item> items;
  std::unique_ptr<Item[]> table;  // token -> position, past LINEAR_EDGES (none before: 32 bytes)
  Edges() = default;
  Edges(Edges &&) = default;
  Edges &operator=(Edges &&) = default;
  Edges(const Edges &o) : items(o.items) {
    if (o.table) {
      size_t size = table_size(items.size());
      table.reset(new Item[size]);
      std::copy(o.table.get(), o.table.get() + size, table.get());
    }
  }
  int find_in_table(int32_t tok) const {  // items.size() > LINEAR_EDGES
    const uint32_t size = table_size(items.size()), mask = size - 1;
    for (uint32_t k = table_slot(tok, size);; k = (k + 1) & mask) {
      const Item &slot = table[k];
      if (slot.first == tok) return slot.second;
      if (slot.first == NO_TOKEN) return -1;
    }
  }
  int find(int32_t tok) const {
    if (items.size() <= LINEAR_EDGES) {
      for (size_t i = 0; i < items.size(); ++i)
        if (items[i].first == tok) return (int)i;
      return -1;
    }
    return find_in_table(tok);
  }
  void place(Item *slots, uint32_t size, int32_t tok, int32_t position) {
    uint32_t k = table_slot(tok, size);
    while (slots[k].first != NO_TOKEN) k = (k + 1) & (size - 1);
    slots[k] = Item(tok, position);
  }
  void add(int32_t tok, int32_t nxt) {  // tok must not be in the list
    items.emplace_back(tok, nxt);
    const size_t n = items.size();
    if (n <= LINEAR_EDGES) return;
    const uint32_t size = table_size(n);
    if (table && size == table_size(n - 1)) {
      place(table.get(), size, tok, (int32_t)n - 1);
      return;
    }
    table.reset(new Item[size]);  // made, or grown: every item placed again
    std::fill(table.get(), table.get() + size, Item(NO_TOKEN, 0));
    for (size_t i = 0; i < n; ++i) place(table.get(), size, items[i].first, (int32_t)i);
  }
  int64_t table_bytes() const { return table ? (int64_t)table_size(items.size()) * (int64_t)sizeof(Item) : 0; }
};

// One state of the automaton, everything a walk reads of it in 32 bytes (one cache line
// holds two): its suffix link, length and weight, and its transitions: none, one (`tok`
// -> `next`), or an edge list (`next` = -1 - its index in `edges`; `tok` = its length and
// `items` its items, kept in step with the list).
struct State {
  int32_t link, length;
  int32_t tok;   // one transition: its token; an edge list: its length
  int32_t next;  // > 0: the one transition's target; < 0: -1 - the edge list; 0: none
  double weight;
  const Item *items;  // an edge list's items
};
static_assert(sizeof(State) == 32, "a state is 32 bytes");

// Every index and every change of one gets a stamp no other has had (ScanCache's key).
uint64_t next_stamp() {
  static uint64_t last = 0;
  return ++last;
}

struct SuffixIndex {
  std::vector<State> st{State{-1, 0, 0, 0, 0.0, nullptr}};
  std::vector<Edges> edges;
  int64_t num_tokens = 0;
  uint64_t stamp = next_stamp();  // a new one at every change of the automaton or its weights

  int32_t size() const { return (int32_t)st.size(); }
  bool has_next(int32_t s) const { return st[(size_t)s].next != 0; }
  const Edges &list(const State &s) const { return edges[(size_t)(-1 - s.next)]; }
  int32_t get(const State &s, int32_t tok) const {  // 0: none (ROOT is never a target)
    if (s.next > 0) return s.tok == tok ? s.next : 0;
    if (s.next == 0) return 0;
    if (s.tok <= (int32_t)LINEAR_EDGES) {
      for (int32_t i = 0; i < s.tok; ++i)
        if (s.items[i].first == tok) return s.items[i].second;
      return 0;
    }
    int i = list(s).find_in_table(tok);
    return i < 0 ? 0 : s.items[i].second;
  }
  int32_t get(int32_t s, int32_t tok) const { return get(st[(size_t)s], tok); }
  void sync(int32_t s) {  // a state's copy of its edge list's length and items
    const Edges &e = edges[(size_t)(-1 - st[(size_t)s].next)];
    st[(size_t)s].tok = (int32_t)e.items.size();
    st[(size_t)s].items = e.items.data();
  }
  int32_t clone(int32_t q, int32_t len, bool propagate) {
    int32_t c = size();
    State copy = st[(size_t)q];
    copy.length = len;
    if (!propagate) copy.weight = 0.0;
    st.push_back(copy);
    if (copy.next < 0) {
      Edges dup = edges[(size_t)(-1 - copy.next)];
      edges.push_back(std::move(dup));
      st[(size_t)c].next = -(int32_t)edges.size();
      sync(c);
    }
    st[(size_t)q].link = c;
    return c;
  }
  void redirect(int32_t p, int32_t tok, int32_t old, int32_t nw) {
    while (p != -1) {
      State &s = st[(size_t)p];
      if (s.next > 0) {
        if (s.next != old || s.tok != tok) return;
        s.next = nw;
      } else {
        if (s.next == 0) return;
        Edges &e = edges[(size_t)(-1 - s.next)];
        int i = e.find(tok);
        if (i < 0 || e.items[(size_t)i].second != old) return;
        e.items[(size_t)i].second = nw;
      }
      p = s.link;
    }
  }
  int32_t extend(int32_t last, int32_t tok, double w, bool propagate) {
    if (size() >= 0x7ffffff0) out_of_memory();
    num_tokens += 1;
    stamp = next_stamp();
    int32_t q = get(last, tok), state;
    const int32_t last_len = st[(size_t)last].length;
    if (q) {
      if (st[(size_t)q].length == last_len + 1) {
        state = q;
      } else {
        state = clone(q, last_len + 1, propagate);
        redirect(last, tok, q, state);
      }
    } else {
      state = size();
      st.push_back(State{0, last_len + 1, 0, 0, 0.0, nullptr});
      int32_t p = last;
      while (p != -1) {
        State &s = st[(size_t)p];
        if (s.next > 0) {
          if (s.tok == tok) { q = s.next; break; }
          Edges e;
          e.items.reserve(4);  // one allocation for the first four continuations (not 1, 2, 4)
          e.add(s.tok, s.next);
          e.add(tok, state);
          edges.push_back(std::move(e));
          s.next = -(int32_t)edges.size();
          sync(p);
        } else if (s.next == 0) {
          s.tok = tok;
          s.next = state;
        } else {
          Edges &e = edges[(size_t)(-1 - s.next)];
          int i = e.find(tok);
          if (i >= 0) { q = e.items[(size_t)i].second; break; }
          e.add(tok, state);
          sync(p);
        }
        p = st[(size_t)p].link;
      }
      if (p != -1) {
        if (st[(size_t)p].length + 1 == st[(size_t)q].length) {
          st[(size_t)state].link = q;
        } else {
          int32_t c = clone(q, st[(size_t)p].length + 1, propagate);
          redirect(p, tok, q, c);
          st[(size_t)state].link = c;
        }
      }
    }
    if (!propagate) { st[(size_t)state].weight += w; return state; }
    int32_t s = state;
    int depth = MAX_PROPAGATION;
    while (s > 0 && depth) { st[(size_t)s].weight += w; s = st[(size_t)s].link; --depth; }
    return state;
  }
  void finalize_weights() {  // by length, longest first; states in ascending order within
    stamp = next_stamp();
    int32_t n = size(), maxlen = 0;
    for (int32_t s = 0; s < n; ++s) maxlen = std::max(maxlen, st[(size_t)s].length);
    std::vector<int32_t> start((size_t)maxlen + 2, 0), order((size_t)std::max(0, n - 1));
    for (int32_t s = 1; s < n; ++s) ++start[(size_t)st[(size_t)s].length + 1];
    for (size_t l = 1; l < start.size(); ++l) start[l] += start[l - 1];
    std::vector<int32_t> at(start.begin(), start.end() - 1);
    for (int32_t s = 1; s < n; ++s) order[(size_t)at[(size_t)st[(size_t)s].length]++] = s;
    for (int64_t l = maxlen; l >= 0; --l)
      for (int32_t k = start[(size_t)l]; k < start[(size_t)l + 1]; ++k) {
        int32_t s = order[(size_t)k], parent = st[(size_t)s].link;
        if (parent > 0) st[(size_t)parent].weight += st[(size_t)s].weight;
      }
  }
  int32_t link(int32_t s) const { return st[(size_t)s].link; }
  int32_t length(int32_t s) const { return st[(size_t)s].length; }
  double weight(int32_t s) const { return st[(size_t)s].weight; }
  int32_t settle(int32_t state, int64_t match_len) const {
    while (state > 0 && match_len <= length(link(state))) state = link(state);
    return state;
  }
  void walk(int32_t &state, int64_t &match_len, int32_t tok) const {
    state = settle(state, match_len);
    int32_t nxt = get(state, tok);
    while (!nxt && state != 0) {
      state = link(state);
      match_len = length(state);
      nxt = get(state, tok);
    }
    if (!nxt) { state = 0; match_len = 0; return; }
    state = nxt;
    match_len += 1;
  }
  int64_t bytes() const {
    int64_t total = (int64_t)st.capacity() * (int64_t)sizeof(State) + (int64_t)edges.capacity() * (int64_t)sizeof(Edges);
    for (const Edges &e : edges) {
      total += (int64_t)e.items.capacity() * 8;
      total += e.table_bytes();
    }
    return total;
  }
};

// ---------------------------------------------------------------- walk.py

struct Src {
  const SuffixIndex *ix;
  int32_t state;
  int64_t len;
  double prior;
};

bool prepare(const SuffixIndex &ix, int32_t state, int64_t match_len, double prior, int64_t min_match_len,
             int64_t anchored_len, Src &out) {
  while (state > 0 && match_len <= ix.length(ix.link(state))) state = ix.link(state);
  while (state > 0 && !ix.has_next(state)) {
    state = ix.link(state);
    match_len = ix.length(state);
  }
  if (state <= 0 || (match_len < min_match_len && match_len != anchored_len)) return false;
  out = Src{&ix, state, match_len, prior};
  return true;
}

struct Scan {
  int32_t token, state;
  double best, total;
};

// walk._scan, of a state with an edge list. FIND: the same pass also finds the continuation
// on `tok` (its target in `found`, else 0), for the walk's back-off scan of a parent, which
// needs both, without a second lookup (past LINEAR_EDGES, one in the list's token map).
template <bool FIND>
Scan scan_edges(const SuffixIndex &ix, const State &s, int32_t tok, int32_t &found) {
  Scan r{0, 0, -1.0, 0.0};
  const State *st = ix.st.data();
  if (FIND) found = 0;
  for (int32_t k = 0; k < s.tok; ++k) {
    const Item &it = s.items[k];
    double w = st[it.second].weight;
    r.total += w;
    if (w > r.best) { r.best = w; r.token = it.first; r.state = it.second; }
    if (FIND && it.first == tok) found = it.second;
  }
  return r;
}

Scan scan(const SuffixIndex &ix, const State &s) {
  int32_t unused;
  return scan_edges<false>(ix, s, 0, unused);
}

// The scans of states with many continuations, kept while their index is unchanged: in a
// step's propose many requests walk the same indexes (a prompt's siblings its index, every
// request the global one), and reach the same short contexts, whose states have hundreds of
// continuations (measured on the SmolLM2 traces: over half of all the edges scanned were a
// scan the same step had made). Direct-mapped by (index, state); an entry holds only while
// its index's stamp is the one it was made at, so a hit is the scan itself, bit for bit.
struct ScanCache {
  static constexpr size_t SIZE = 4096;   // entries (a power of two)
  static constexpr int32_t WIDE = 16;    // continuations from which a scan is kept
  struct Entry {
    const SuffixIndex *ix = nullptr;
    uint64_t stamp = 0;
    int32_t state = -1;
    Scan scan;
  };
  std::vector<Entry> entries = std::vector<Entry>(SIZE);

  Scan get(const SuffixIndex &ix, int32_t state, const State &s) {
    if (s.tok <= WIDE) return scan(ix, s);
    size_t h = ((uintptr_t)&ix >> 4) * 0x9E3779B97F4A7C15ull ^ (uint64_t)(uint32_t)state * 0xC2B2AE3D27D4EB4Full;
    Entry &e = entries[(h >> 32) & (SIZE - 1)];
    if (e.ix != &ix || e.stamp != ix.stamp || e.state != state) e = Entry{&ix, ix.stamp, state, scan(ix, s)};
    return e.scan;
  }
};

double prob(const SuffixIndex &ix, int32_t state, int32_t token, double smoothing, double backoff, bool neumaier) {
  const State &s = ix.st[(size_t)state];
  int32_t parent = s.link;
  const State &ps = ix.st[(size_t)parent];
  int32_t up = ix.get(ps, token);
  int32_t nxt;
  double total, escape;
  if (s.next > 0) {
    nxt = s.tok == token ? s.next : 0;
    if (!nxt && !up) return 0.0;
    total = ix.weight(s.next);
    escape = backoff * 1 + smoothing;
  } else {
    nxt = ix.get(s, token);
    if (!nxt && !up) return 0.0;
    PySum sum(neumaier);
    for (int32_t k = 0; k < s.tok; ++k) sum.add(ix.weight(s.items[k].second));
    total = sum.get();
    escape = backoff * (double)s.tok + smoothing;
  }
  double w = nxt ? ix.weight(nxt) : 0.0;
  if (parent <= 0) return w / (total + smoothing);
  return (up ? (w + escape * (ix.weight(up) / (ps.weight + smoothing))) : w) / (total + escape);
}

// prob() for a state whose continuations' total (as prob sums them) and escape are known
// (the walk's step has them from its scan): the same value, without summing again.
double prob_given(const SuffixIndex &ix, const State &s, int32_t token, double total, double escape,
                  double smoothing) {
  const State &ps = ix.st[(size_t)s.link];
  int32_t up = ix.get(ps, token), nxt = ix.get(s, token);
  if (!nxt && !up) return 0.0;
  double w = nxt ? ix.weight(nxt) : 0.0;
  if (s.link <= 0) return w / (total + smoothing);
  return (up ? (w + escape * (ix.weight(up) / (ps.weight + smoothing))) : w) / (total + escape);
}

bool follow(Src &s, int32_t token, int32_t nxt, int64_t min_match_len) {  // walk._follow; nxt < 0: unknown
  const SuffixIndex &ix = *s.ix;
  int32_t state = s.state;
  if (nxt < 0) {
    nxt = ix.get(state, token);
    if (!nxt) {
      while (!nxt && ix.length(ix.link(state)) >= min_match_len) {
        state = ix.link(state);
        s.len = ix.length(state);
        nxt = ix.get(state, token);
      }
      if (!nxt) return false;
    }
  }
  if (ix.has_next(nxt)) {
    s.state = nxt;
    s.len += 1;
    return true;
  }
  state = nxt;  // a dead end: back off
  while (ix.length(ix.link(state)) >= min_match_len) {
    state = ix.link(state);
    if (ix.has_next(state)) {
      s.state = state;
      s.len = ix.length(state);
      return true;
    }
  }
  return false;
}

struct Params {
  double smoothing, backoff, min_gain;
  int64_t min_match_len;
  bool neumaier;
  ScanCache *scans;  // the drafter's (never null)
};

// walk.steps as a resumable walk: next() yields the draft's tokens one by one.
struct Walk {
  Src src[3];
  int n = 0;
  double gain = 0.0, calibration = 1.0;
  int64_t cap = 0, num = 0;
  const std::vector<int32_t> *stops = nullptr;
  bool done = true;
  // a materialized walk (computed whole before a later request mutates the indexes)
  std::vector<int32_t> toks;
  std::vector<double> gains;
  size_t replay = 0;
  bool materialized = false;

  bool step(const Params &pp, int32_t &tok_out, double &gain_out) {
    if (materialized) {
      if (replay >= toks.size()) return false;
      tok_out = toks[replay];
      gain_out = gains[replay++];
      return true;
    }
    if (done || num >= cap || n == 0) { done = true; return false; }
    struct View { int32_t tok, nxt; double own, total, escape; } views[3];
    int32_t backoffs[3];
    int nb = 0;
    int32_t token = 0;
    bool agree = true;
    const double single_escape = pp.backoff * 1 + pp.smoothing;
    for (int i = 0; i < n; ++i) {
      const SuffixIndex &ix = *src[i].ix;
      const State &cur = ix.st[(size_t)src[i].state];
      int32_t nxt = cur.next, tok;
      double w, total, escape;
      if (nxt > 0) {
        tok = cur.tok;
        w = total = ix.weight(nxt);
        escape = single_escape;
      } else {
        Scan sc = pp.scans->get(ix, src[i].state, cur);
        tok = sc.token; nxt = sc.state; w = sc.best; total = sc.total;
        escape = pp.backoff * (double)cur.tok + pp.smoothing;
      }
      int32_t parent = cur.link;
      double own;
      if (parent <= 0) {
        own = w / (total + pp.smoothing);
      } else {
        const State &ps = ix.st[(size_t)parent];
        int32_t up = 0;
        if (ps.next > 0) {
          if (ps.length >= pp.min_match_len) backoffs[nb++] = ps.tok;
          if (ps.tok == tok) up = ps.next;
        } else if (ps.next < 0) {
          if (ps.tok > ScanCache::WIDE) {
            if (ps.length >= pp.min_match_len) backoffs[nb++] = pp.scans->get(ix, parent, ps).token;
            up = ix.get(ps, tok);
          } else if (ps.length >= pp.min_match_len) {
            backoffs[nb++] = scan_edges<true>(ix, ps, tok, up).token;
          } else {
            up = ix.get(ps, tok);
          }
        }
        own = (up ? (w + escape * (ix.weight(up) / (ps.weight + pp.smoothing))) : w) / (total + escape);
      }
      views[i] = View{tok, nxt, own, total, escape};
      if (i == 0) token = tok;
      else if (tok != token) agree = false;
    }
    if (agree)
      for (int b = 0; b < nb; ++b)
        if (backoffs[b] != token) { agree = false; break; }
    double p, trusts[3];
    if (!(agree && n == 1)) {
      for (int i = 0; i < n; ++i) trusts[i] = (double)src[i].len / ((double)src[i].len + src[i].prior);
    }
    if (agree) {
      if (n == 1) {
        p = views[0].own;
      } else {
        double score = 0.0;
        PySum sum(pp.neumaier);
        for (int i = 0; i < n; ++i) { score += trusts[i] * views[i].own; sum.add(trusts[i]); }
        p = score / sum.get();
      }
    } else {
      PySet cands;
      for (int i = 0; i < n; ++i) cands.add(views[i].tok);
      for (int b = 0; b < nb; ++b) cands.add(backoffs[b]);
      p = -1.0;
      token = 0;
      // prob()'s total of a state's continuations is the scan's running total (the same
      // additions in the same order), but Python 3.12's sum() compensates: summed again then.
      if (pp.neumaier)
        for (int i = 0; i < n; ++i) {
          const State &cur = src[i].ix->st[(size_t)src[i].state];
          if (cur.next > 0) continue;
          PySum sum(true);
          for (int32_t e = 0; e < cur.tok; ++e) sum.add(src[i].ix->weight(cur.items[e].second));
          views[i].total = sum.get();
        }
      for (size_t k = 0; k <= cands.mask; ++k) {
        if (!cands.used[k]) continue;
        int32_t cand = cands.table[k];
        double score = 0.0;
        for (int i = 0; i < n; ++i)
          score += trusts[i] * (views[i].tok == cand
                                    ? views[i].own
                                    : prob_given(*src[i].ix, src[i].ix->st[(size_t)src[i].state], cand,
                                                 views[i].total, views[i].escape, pp.smoothing));
        if (score > p) { p = score; token = cand; }
      }
      PySum sum(pp.neumaier);
      for (int i = 0; i < n; ++i) sum.add(trusts[i]);
      p /= sum.get();
    }
    double q = p * calibration;
    gain *= q < 0.99 ? q : 0.99;
    if (gain < pp.min_gain) { done = true; return false; }
    tok_out = token;
    gain_out = gain;
    num += 1;
    if (stops != nullptr && std::find(stops->begin(), stops->end(), token) != stops->end()) {
      done = true;
      return true;
    }
    int kept = 0;
    for (int i = 0; i < n; ++i) {
      Src s = src[i];
      bool ok;
      if (views[i].tok != token) {
        ok = follow(s, token, -1, pp.min_match_len);
      } else if (s.ix->has_next(views[i].nxt)) {
        s.state = views[i].nxt;
        s.len += 1;
        ok = true;
      } else {
        ok = follow(s, token, views[i].nxt, pp.min_match_len);
      }
      if (ok) src[kept++] = s;
    }
    n = kept;
    return true;
  }
  void reset() {  // as new, keeping the buffers' memory
    n = 0;
    gain = 0.0;
    calibration = 1.0;
    cap = num = 0;
    stops = nullptr;
    done = true;
    toks.clear();
    gains.clear();
    replay = 0;
    materialized = false;
  }
  void materialize(const Params &pp) {
    int32_t t;
    double g;
    while (step(pp, t, g)) { toks.push_back(t); gains.push_back(g); }
    materialized = true;
  }
};

// ---------------------------------------------------------------- tree_walk.py

struct SrcSet {  // a tree node's live sources (tree_walk: a node's `sources` list)
  Src src[3];
  int n = 0;
};

// tree_walk.tree_steps, run whole (a request's tree is computed before the next request's
// sources catch up): the nodes best first into toks/gains/parents. Scratch reused.
struct TreeWalk {
  struct Entry {  // heapq's (-gain, tie, token, parent, sources, depth)
    double gain;
    int64_t tie;
    int32_t token, parent, set;
    int64_t depth;
  };
  struct Later {  // heapq's order: higher gain first, then the candidate pushed first
    bool operator()(const Entry &a, const Entry &b) const {
      return a.gain < b.gain || (a.gain == b.gain && a.tie > b.tie);
    }
  };
  std::vector<Entry> heap;
  std::vector<SrcSet> sets;
  std::vector<int32_t> offered, order, heaviest_out;
  std::vector<std::pair<double, int32_t>> scored;
  int64_t tie = 0;

  // tree_walk._heaviest: the k heaviest continuations (first of equal weights in the index's order)
  void heaviest(const SuffixIndex &ix, int32_t state, int64_t k) {
    heaviest_out.clear();
    const State &cur = ix.st[(size_t)state];
    if (cur.next > 0) { heaviest_out.push_back(cur.tok); return; }
    if (cur.next == 0) return;
    const auto &items = ix.list(cur).items;
    if (items.empty()) return;
    if (k == 1) {
      double best = -1.0;
      int32_t token = 0;
      for (const auto &it : items)
        if (ix.weight(it.second) > best) { best = ix.weight(it.second); token = it.first; }
      heaviest_out.push_back(token);
      return;
    }
    order.resize(items.size());
    for (size_t i = 0; i < items.size(); ++i) order[i] = (int32_t)i;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return ix.weight(items[(size_t)a].second) > ix.weight(items[(size_t)b].second);
    });
    size_t m = (size_t)std::min<int64_t>(k, (int64_t)items.size());
    for (size_t i = 0; i < m; ++i) heaviest_out.push_back(items[(size_t)order[i]].first);
  }
  void offer() {  // a dict's update: insertion order, no duplicates
    for (int32_t t : heaviest_out)
      if (std::find(offered.begin(), offered.end(), t) == offered.end()) offered.push_back(t);
  }
  // tree_walk.candidates: (p, token) best first, ties in the order offered
  void candidates(const SrcSet &ss, int64_t width, const Params &pp) {
    offered.clear();
    for (int i = 0; i < ss.n; ++i) {
      const SuffixIndex &ix = *ss.src[i].ix;
      heaviest(ix, ss.src[i].state, width);
      offer();
      int32_t parent = ix.link(ss.src[i].state);
      if (parent > 0 && ix.length(parent) >= pp.min_match_len) {
        heaviest(ix, parent, 1);
        offer();
      }
    }
    double trusts[3];
    PySum total(pp.neumaier);
    for (int i = 0; i < ss.n; ++i) {
      trusts[i] = (double)ss.src[i].len / ((double)ss.src[i].len + ss.src[i].prior);
      total.add(trusts[i]);
    }
    const double denom = total.get();
    scored.clear();
    for (int32_t token : offered) {
      PySum sum(pp.neumaier);
      for (int i = 0; i < ss.n; ++i)
        sum.add(trusts[i] * prob(*ss.src[i].ix, ss.src[i].state, token, pp.smoothing, pp.backoff, pp.neumaier));
      scored.emplace_back(sum.get() / denom, token);
    }
    std::stable_sort(scored.begin(), scored.end(),
                     [](const std::pair<double, int32_t> &a, const std::pair<double, int32_t> &b) {
                       return a.first > b.first;
                     });
  }
  void expand(int32_t set, int32_t node, double node_gain, int64_t depth, int64_t width, const Params &pp,
              double calibration) {
    candidates(sets[(size_t)set], width, pp);
    size_t m = (size_t)std::min<int64_t>(width, (int64_t)scored.size());
    for (size_t k = 0; k < m; ++k) {
      double q = scored[k].first * calibration;
      double child_gain = node_gain * (q < 0.99 ? q : 0.99);
      if (child_gain >= pp.min_gain) {
        heap.push_back(Entry{child_gain, tie++, scored[k].second, node, set, depth + 1});
        std::push_heap(heap.begin(), heap.end(), Later());
      }
    }
  }
  // The tree of a walk made by make_walk (its sources, gain, calibration and stops) into the
  // walk's materialized tokens and gains, and its nodes' parents.
  void grow(Walk &w, int64_t cap, int64_t max_depth, int64_t width, const Params &pp,
            std::vector<int32_t> &parents) {
    w.toks.clear();
    w.gains.clear();
    w.replay = 0;
    w.materialized = true;
    parents.clear();
    if (cap <= 0 || max_depth <= 0) return;
    heap.clear();
    sets.clear();
    tie = 0;
    SrcSet root;
    root.n = w.n;
    for (int i = 0; i < w.n; ++i) root.src[i] = w.src[i];
    sets.push_back(root);
    expand(0, -1, w.gain, 0, width, pp, w.calibration);
    int64_t num_nodes = 0;
    while (!heap.empty() && num_nodes < cap) {
      std::pop_heap(heap.begin(), heap.end(), Later());
      Entry e = heap.back();
      heap.pop_back();
      parents.push_back(e.parent);
      w.toks.push_back(e.token);
      w.gains.push_back(e.gain);
      int32_t node = (int32_t)num_nodes++;
      if ((w.stops != nullptr && std::find(w.stops->begin(), w.stops->end(), e.token) != w.stops->end()) ||
          e.depth >= max_depth)
        continue;
      SrcSet followed;
      const SrcSet from = sets[(size_t)e.set];
      for (int i = 0; i < from.n; ++i) {
        Src s = from.src[i];  // the parent's sources serve its other children too
        if (follow(s, e.token, -1, pp.min_match_len)) followed.src[followed.n++] = s;
      }
      if (followed.n) {
        sets.push_back(followed);
        expand((int32_t)sets.size() - 1, node, e.gain, e.depth, width, pp, w.calibration);
      }
    }
  }
};

// ---------------------------------------------------------------- prompt_index.py

struct LiveSeq {
  std::vector<int32_t> tokens;
  bool shared = true, indexed = false;
  int32_t state = 0;
  int64_t match_len = 0;
};

struct HistResp {
  std::vector<int32_t> tokens;  // START + the response
  int64_t age;
  double weight;
};

struct PromptIndex {
  int64_t max_tokens;
  double sibling_weight, prompt_weight;
  SuffixIndex index;
  std::vector<HistResp> history;
  bool has_prompt = false;
  std::vector<int32_t> prompt;
  std::vector<std::pair<int32_t, LiveSeq *>> live;  // in insertion order (a dict's)
  std::vector<std::vector<int32_t>> finished;
  bool frozen = false, released = false;

  PromptIndex(int64_t m, double sw, double pw) : max_tokens(m), sibling_weight(sw), prompt_weight(pw) {}
  int64_t num_tokens() const { return index.num_tokens; }

  void set_history(std::vector<HistResp> responses, int64_t budget) {
    std::stable_sort(responses.begin(), responses.end(),
                     [](const HistResp &a, const HistResp &b) { return a.age < b.age; });
    std::vector<HistResp> kept;
    int64_t used = 0;
    for (auto &r : responses) {
      if (used + (int64_t)r.tokens.size() > budget) break;
      used += (int64_t)r.tokens.size();
      kept.push_back(std::move(r));
    }
    history = std::move(kept);
    rebuild();
  }
  void set_prompt(const int32_t *p, int64_t n) {
    if (has_prompt || n > max_tokens / 4 || num_tokens() + n > max_tokens) return;
    has_prompt = true;
    prompt.assign(p, p + n);
    int32_t last = 0;
    for (int32_t t : prompt) last = index.extend(last, t, prompt_weight, true);
  }
  void add_live(int32_t slot, LiveSeq *seq) {
    live.emplace_back(slot, seq);
    std::vector<int32_t> tokens;
    tokens.swap(seq->tokens);
    seq->indexed = seq->shared && !frozen;
    seq->state = 0;
    seq->match_len = 0;
    append(seq, tokens.data(), (int64_t)tokens.size());
  }
  void finish(int32_t slot) {
    for (size_t i = 0; i < live.size(); ++i)
      if (live[i].first == slot) {
        LiveSeq *seq = live[i].second;
        live.erase(live.begin() + (long)i);
        if (seq->shared) finished.push_back(seq->tokens);
        return;
      }
  }
  void append(LiveSeq *seq, const int32_t *tokens, int64_t n) {
    if (seq->indexed && index.num_tokens + n > max_tokens) make_room(n);
    if (seq->indexed) {
      int32_t last = seq->state;
      for (int64_t i = 0; i < n; ++i) last = index.extend(last, tokens[i], sibling_weight, true);
      seq->state = last;
      seq->match_len = index.length(last);
    } else {
      int32_t state = seq->state;
      int64_t match_len = seq->match_len;
      for (int64_t i = 0; i < n; ++i) index.walk(state, match_len, tokens[i]);
      seq->state = state;
      seq->match_len = match_len;
    }
    seq->tokens.insert(seq->tokens.end(), tokens, tokens + n);
  }
  void make_room(int64_t num_new) {
    int64_t need = num_tokens() + num_new;
    bool dropped = false;
    while (need > max_tokens && !history.empty()) {
      int64_t oldest = history[0].age;
      for (auto &r : history) oldest = std::max(oldest, r.age);
      std::vector<HistResp> rest;
      for (auto &r : history) {
        if (r.age == oldest) need -= (int64_t)r.tokens.size();
        else rest.push_back(std::move(r));
      }
      history = std::move(rest);
      dropped = true;
    }
    if (dropped) rebuild();
    if (num_tokens() + num_new > max_tokens) {
      frozen = true;
      for (auto &l : live) l.second->indexed = false;
    }
  }
  int32_t insert(const std::vector<int32_t> &tokens, double weight) {
    int32_t last = 0;
    for (int32_t t : tokens) last = index.extend(last, t, weight, false);
    return last;
  }
  void rebuild() {
    index = SuffixIndex();
    frozen = false;
    if (has_prompt) insert(prompt, prompt_weight);
    for (auto &r : history) insert(r.tokens, r.weight);
    std::vector<std::vector<int32_t>> kept;
    for (auto &tokens : finished)
      if (index.num_tokens + (int64_t)tokens.size() <= max_tokens) {
        insert(tokens, sibling_weight);
        kept.push_back(std::move(tokens));
      }
    finished = std::move(kept);
    std::vector<LiveSeq *> tracked;
    for (auto &l : live) {
      LiveSeq *seq = l.second;
      if (!seq->shared || index.num_tokens + (int64_t)seq->tokens.size() > max_tokens) {
        frozen = frozen || seq->shared;
        tracked.push_back(seq);
        continue;
      }
      int32_t last = insert(seq->tokens, sibling_weight);
      seq->indexed = true;
      seq->state = last;
      seq->match_len = index.length(last);
    }
    index.finalize_weights();
    for (LiveSeq *seq : tracked) {
      seq->indexed = false;
      int32_t state = 0;
      int64_t match_len = 0;
      for (int32_t t : seq->tokens) index.walk(state, match_len, t);
      seq->state = state;
      seq->match_len = match_len;
    }
  }
  int64_t bytes() const {
    int64_t total = index.bytes() + (int64_t)prompt.capacity() * 4;
    for (auto &r : history) total += (int64_t)r.tokens.capacity() * 4 + (int64_t)sizeof(HistResp);
    for (auto &f : finished) total += (int64_t)f.capacity() * 4 + 24;
    return total;
  }
};

// ---------------------------------------------------------------- global_index.py

struct GlobalMatch {
  int64_t flips = 0;
  int32_t states[2] = {0, 0};
  int64_t lens[2] = {0, 0};
};

struct FedEntry {
  std::vector<int32_t> text;
  int64_t flips;
  int32_t last;
};

struct GlobalIndex {
  int64_t max_tokens;
  std::vector<std::unique_ptr<SuffixIndex>> gens;  // newest first
  int64_t flips = 0, num_responses = 0;
  struct Bucket {
    std::vector<FedEntry> entries;
    std::list<const std::vector<int32_t> *>::iterator order;
  };
  std::map<std::vector<int32_t>, Bucket> fed;
  std::list<const std::vector<int32_t> *> fed_order;  // oldest first

  explicit GlobalIndex(int64_t m) : max_tokens(m) { gens.emplace_back(new SuffixIndex()); }
  int64_t num_tokens() const {
    int64_t n = 0;
    for (auto &g : gens) n += g->num_tokens;
    return n;
  }
  SuffixIndex &room(int64_t num_new) {
    SuffixIndex &newest = *gens[0];
    if (newest.num_tokens + num_new > max_tokens / 2 && newest.num_tokens) {
      std::unique_ptr<SuffixIndex> fresh(new SuffixIndex());
      std::unique_ptr<SuffixIndex> old = std::move(gens[0]);
      gens.clear();
      gens.push_back(std::move(fresh));
      gens.push_back(std::move(old));
      flips += 1;
    }
    return *gens[0];
  }
  void add(const int32_t *tokens, int64_t n) {
    if (indexed_live(tokens, n)) return;
    std::vector<int32_t> seq;
    seq.reserve((size_t)n + 1);
    seq.push_back(START);
    seq.insert(seq.end(), tokens, tokens + n);
    if ((int64_t)seq.size() > max_tokens / 2) seq.resize((size_t)(max_tokens / 2));
    SuffixIndex &newest = room((int64_t)seq.size());
    int32_t last = 0;
    for (int32_t t : seq) last = newest.extend(last, t, 1.0, true);
    num_responses += 1;
  }
  void start_match(GlobalMatch &m, const std::vector<int32_t> &text) { enter(m, text, 0, false); }
  void follow_text(GlobalMatch &m, const std::vector<int32_t> &text, int64_t nnew) {
    SuffixIndex *newest = gens[0].get();
    if (m.flips != flips || newest->num_tokens + nnew > max_tokens / 2) {
      enter(m, text, nnew, true);
      return;
    }
    int64_t begin = (int64_t)text.size() - nnew;
    if (gens.size() > 1) {
      const SuffixIndex &older = *gens[1];
      int32_t state = m.states[1];
      int64_t length = m.lens[1];
      for (int64_t i = begin; i < (int64_t)text.size(); ++i) older.walk(state, length, text[(size_t)i]);
      m.states[1] = state;
      m.lens[1] = length;
    }
    int32_t last = m.states[0];
    for (int64_t i = begin; i < (int64_t)text.size(); ++i) last = newest->extend(last, text[(size_t)i], 1.0, true);
    m.states[0] = last;
    m.lens[0] = newest->length(last);
  }
  void enter(GlobalMatch &m, const std::vector<int32_t> &text, int64_t nnew, bool carried) {
    int64_t was = m.flips, size = (int64_t)text.size();
    int64_t tail = std::min(std::min(size, REMATCH_TOKENS + nnew), max_tokens / 2);
    SuffixIndex &newest = room(tail);
    if (gens.size() == 1) {
      m.states[1] = 0;
      m.lens[1] = 0;
    } else if (carried && flips - was == 1) {
      int32_t state = m.states[0];
      int64_t length = m.lens[0];
      for (int64_t i = size - nnew; i < size; ++i) gens[1]->walk(state, length, text[(size_t)i]);
      m.states[1] = state;
      m.lens[1] = length;
    } else {
      int32_t state = 0;
      int64_t length = 0;
      for (int64_t i = std::max<int64_t>(0, size - REMATCH_TOKENS); i < size; ++i)
        gens[1]->walk(state, length, text[(size_t)i]);
      m.states[1] = state;
      m.lens[1] = length;
    }
    int32_t last = 0;
    for (int64_t i = size - tail; i < size; ++i) last = newest.extend(last, text[(size_t)i], 1.0, true);
    m.states[0] = last;
    m.lens[0] = newest.length(last);
    m.flips = flips;
  }
  void finish(const GlobalMatch &m, std::vector<int32_t> text) {
    // text = START + tokens: keyed by its first KEY_TOKENS tokens
    size_t end = std::min(text.size(), (size_t)(1 + KEY_TOKENS));
    std::vector<int32_t> key(text.begin() + 1, text.begin() + (long)end);
    auto it = fed.find(key);
    if (it == fed.end()) {
      it = fed.emplace(std::move(key), Bucket()).first;
      fed_order.push_back(&it->first);
    } else {
      fed_order.splice(fed_order.end(), fed_order, it->second.order);
    }
    it->second.order = std::prev(fed_order.end());
    it->second.entries.push_back(FedEntry{std::move(text), m.flips, m.states[0]});
    if (fed.size() > MAX_FED) {
      const std::vector<int32_t> *oldest = fed_order.front();
      fed_order.pop_front();
      fed.erase(*oldest);
    }
  }
  bool take_fed(const int32_t *tokens, int64_t n, FedEntry &out) {
    for (int64_t k = std::min(KEY_TOKENS, n); k >= 0; --k) {
      auto it = fed.find(std::vector<int32_t>(tokens, tokens + k));
      if (it == fed.end()) continue;
      auto &entries = it->second.entries;
      for (size_t e = 0; e < entries.size(); ++e) {
        const auto &text = entries[e].text;
        int64_t tl = (int64_t)text.size() - 1;
        if (tl <= n && std::equal(text.begin() + 1, text.end(), tokens)) {
          out = std::move(entries[e]);
          entries.erase(entries.begin() + (long)e);
          if (entries.empty()) {
            fed_order.erase(it->second.order);
            fed.erase(it);
          }
          return true;
        }
      }
    }
    return false;
  }
  bool indexed_live(const int32_t *tokens, int64_t n) {
    FedEntry found;
    if (!take_fed(tokens, n, found)) return false;
    int64_t done = (int64_t)found.text.size() - 1;
    SuffixIndex &newest = *gens[0];
    if (found.flips != flips || newest.num_tokens + n - done > max_tokens / 2) return done == n;
    int32_t last = found.last;
    for (int64_t i = done; i < n; ++i) last = newest.extend(last, tokens[i], 1.0, true);
    return true;
  }
  int64_t bytes() const {
    int64_t total = 0;
    for (auto &g : gens) total += g->bytes();
    for (auto &b : fed)
      for (auto &e : b.second.entries) total += (int64_t)e.text.capacity() * 4 + (int64_t)sizeof(FedEntry);
    return total;
  }
};

// ---------------------------------------------------------------- drafter.py

struct Config {
  bool use_history, use_siblings, use_prompt, use_global, neumaier;
  int64_t max_tokens_per_prompt, history_budget, global_max_tokens, min_match_len, max_draft_len, max_slots;
  double sibling_weight, prompt_weight, smoothing, backoff, match_len_prior, global_match_len_prior;
};

struct Slot {
  bool live = false;
  int64_t prompt = 0;
  LiveSeq seq;
  bool has_glob = false;
  GlobalMatch glob;
  double obs = 0.0, pred = 0.0, calibration_used = 1.0;
  std::vector<double> last_gains;
  std::vector<int32_t> stops;
  double calibration() const { return std::min(1.5, std::max(0.25, (obs + 1.0) / (pred + 1.0))); }
};

struct Drafter {
  Config cfg;
  std::vector<Slot> slots;
  std::unordered_map<int64_t, std::unique_ptr<PromptIndex>> prompts;
  std::unique_ptr<GlobalIndex> global;
  double *stats;
  double draft_per_seq = 2.0, gain_per_seq = 1.0;
  int64_t num_asked = 0, num_empty = 0, num_draft_tokens = 0, num_accepted = 0;
  char error[256] = {0};
  bool broken = false;
  std::vector<Walk> walks;  // scratch of propose, reused
  ScanCache scans;          // wide states' scans, across the walks of a step (and after, while valid)
  TreeWalk tree_walk;       // scratch of the trees' propose, reused
  std::vector<std::vector<int32_t>> sc_parents;  // row i: request i's tree's parents

  Drafter(const Config &c, double *st) : cfg(c), slots((size_t)c.max_slots), stats(st) {
    if (cfg.use_global) global.reset(new GlobalIndex(cfg.global_max_tokens));
    publish();
  }
  void publish() {
    stats[RHD_STAT_DRAFT_PER_SEQ] = draft_per_seq;
    stats[RHD_STAT_GAIN_PER_SEQ] = gain_per_seq;
    stats[RHD_STAT_NUM_ASKED] = (double)num_asked;
    stats[RHD_STAT_NUM_EMPTY] = (double)num_empty;
    stats[RHD_STAT_NUM_DRAFT_TOKENS] = (double)num_draft_tokens;
    stats[RHD_STAT_NUM_ACCEPTED] = (double)num_accepted;
  }
  PromptIndex &prompt(int64_t id) {
    auto it = prompts.find(id);
    if (it == prompts.end())
      it = prompts.emplace(id, std::unique_ptr<PromptIndex>(new PromptIndex(
                                   cfg.max_tokens_per_prompt, cfg.sibling_weight, cfg.prompt_weight))).first;
    it->second->released = false;
    return *it->second;
  }
  Slot &live_slot(int64_t slot) {
    if (slot < 0 || slot >= cfg.max_slots) invalid("slot %lld out of range [0, %lld)", slot, cfg.max_slots);
    Slot &s = slots[(size_t)slot];
    if (!s.live) invalid("slot %lld is not running", slot);
    return s;
  }
  static void check_tokens(const int32_t *t, int64_t n, const char *what) {
    if (n < 0) invalid("negative token count %lld", n);
    if (n > 0 && t == nullptr) invalid("null token array");
    for (int64_t i = 0; i < n; ++i)
      if (t[i] < 0 || t[i] > MAX_TOKEN) {
        Guard *g = current;
        if (g == nullptr) abort();
        std::snprintf(g->error, 256, "%s: token id %d at %lld is out of range", what, t[i], (long long)i);
        longjmp(g->env, 2);
      }
  }

  void load_history(int64_t pid, const int32_t *tokens, const int64_t *offsets, int32_t num, const int32_t *ages,
                    const double *weights) {
    if (num < 0 || (num > 0 && (offsets == nullptr || ages == nullptr || weights == nullptr)))
      invalid("bad history arrays");
    if (num > 0) {
      if (offsets[0] != 0) invalid("offsets must start at 0");
      for (int32_t r = 0; r < num; ++r)
        if (offsets[r + 1] < offsets[r]) invalid("offsets decrease at response %lld", r);
      check_tokens(tokens, offsets[num], "history");
      for (int32_t r = 0; r < num; ++r)
        if (!(weights[r] >= 0.0) || !std::isfinite(weights[r]) || ages[r] < 0)
          invalid("response %lld: bad age or weight", r);
    }
    PromptIndex &entry = prompt(pid);
    if (!cfg.use_history) return;
    std::vector<HistResp> history;
    history.reserve((size_t)num);
    for (int32_t r = 0; r < num; ++r) {
      HistResp h;
      h.tokens.reserve((size_t)(offsets[r + 1] - offsets[r] + 1));
      h.tokens.push_back(START);
      h.tokens.insert(h.tokens.end(), tokens + offsets[r], tokens + offsets[r + 1]);
      h.age = ages[r];
      h.weight = weights[r];
      history.push_back(std::move(h));
    }
    entry.set_history(std::move(history), cfg.history_budget);
  }
  void add_global(const int32_t *tokens, const int64_t *offsets, int32_t num) {
    if (num < 0 || (num > 0 && offsets == nullptr)) invalid("bad response arrays");
    if (num > 0) {
      if (offsets[0] != 0) invalid("offsets must start at 0");
      for (int32_t r = 0; r < num; ++r)
        if (offsets[r + 1] < offsets[r]) invalid("offsets decrease at response %lld", r);
      check_tokens(tokens, offsets[num], "global responses");
    }
    if (!global) return;
    for (int32_t r = 0; r < num; ++r) global->add(tokens + offsets[r], offsets[r + 1] - offsets[r]);
  }
  void start(int64_t slot, int64_t pid, const int32_t *ptoks, int64_t np, const int32_t *gen, int64_t ng) {
    if (slot < 0 || slot >= cfg.max_slots) invalid("slot %lld out of range [0, %lld)", slot, cfg.max_slots);
    check_tokens(ptoks, np, "prompt_token_ids");
    check_tokens(gen, ng, "generated_token_ids");
    Slot &s = slots[(size_t)slot];
    if (s.live) invalid("slot %lld is already running", slot);
    PromptIndex &entry = prompt(pid);
    if (cfg.use_prompt) entry.set_prompt(ptoks, np);
    s.seq = LiveSeq();
    s.seq.tokens.reserve((size_t)ng + 1);
    s.seq.tokens.push_back(START);
    s.seq.tokens.insert(s.seq.tokens.end(), gen, gen + ng);
    s.seq.shared = cfg.use_siblings;
    s.live = true;
    s.prompt = pid;
    s.obs = s.pred = 0.0;
    s.calibration_used = 1.0;
    s.last_gains.clear();
    s.stops.clear();
    s.has_glob = false;
    entry.add_live((int32_t)slot, &s.seq);
    if (global) {
      s.glob = GlobalMatch();
      global->start_match(s.glob, s.seq.tokens);
      s.has_glob = true;
    }
  }
  int stop(int64_t slot) {
    Slot &s = live_slot(slot);
    s.live = false;
    auto it = prompts.find(s.prompt);
    PromptIndex &entry = *it->second;
    entry.finish((int32_t)slot);
    if (s.has_glob) global->finish(s.glob, std::move(s.seq.tokens));
    s.seq = LiveSeq();
    s.last_gains.clear();
    if (entry.released && entry.live.empty()) {
      prompts.erase(it);
      return 1;
    }
    return 0;
  }
  int release(int64_t pid) {
    auto it = prompts.find(pid);
    if (it == prompts.end()) return 1;
    if (!it->second->live.empty()) {
      it->second->released = true;
      return 0;
    }
    prompts.erase(it);
    return 1;
  }
  void accept(Slot &s, int64_t num_draft, int64_t num_accepted_) {  // record_acceptance
    size_t ng = std::min((size_t)std::max<int64_t>(0, num_draft), s.last_gains.size());
    if (ng == 0) return;
    double previous = 1.0, expected = 0.0;
    size_t upto = std::min(ng, (size_t)std::max<int64_t>(0, num_accepted_ + 1));
    for (size_t i = 0; i < upto; ++i) {
      double g = s.last_gains[i];
      expected += g / previous;
      previous = g;
    }
    s.obs += (double)num_accepted_;
    s.pred += expected / s.calibration_used;
    num_accepted += num_accepted_;
    s.last_gains.clear();
  }
  void add_tokens(Slot &s, const int32_t *tokens, int64_t n) {
    s.obs *= DECAY;
    s.pred *= DECAY;
    prompts.find(s.prompt)->second->append(&s.seq, tokens, n);
    if (s.has_glob) global->follow_text(s.glob, s.seq.tokens, n);
  }
  // A step's commits, one row per request in order (HistoDrafter.commit_step): drafts[i] > 0:
  // record_acceptance(drafts[i], accepted[i]); -1: record_tree_acceptance of a path of
  // accepted[i] nodes; 0: none. Then counts[i] >= 0: add_tokens of the next counts[i]
  // tokens; -1: none. All validated before any is applied.
  void commit(int32_t n, const int32_t *slot_ids, const int32_t *drafts, const int32_t *accepted,
              const int32_t *counts, const int32_t *tokens, int64_t num_tokens) {
    if (n < 0 || (n > 0 && (slot_ids == nullptr || drafts == nullptr || accepted == nullptr || counts == nullptr)))
      invalid("bad commit arrays");
    if (num_tokens < 0) invalid("negative token count %lld", num_tokens);
    int64_t used = 0;
    for (int32_t k = 0; k < n; ++k) {  // validate everything first: all or nothing
      live_slot(slot_ids[k]);
      if (drafts[k] < -1 || accepted[k] < 0) invalid("commit %lld: bad draft or accepted count", k);
      if (counts[k] < -1 || (counts[k] > 0 && used + counts[k] > num_tokens))
        invalid("commit %lld: token count past the array", k);
      if (counts[k] > 0) used += counts[k];
    }
    if (used != num_tokens) invalid("the token counts add up to %lld, not the %lld tokens given", used, num_tokens);
    check_tokens(tokens, used, "committed token_ids");
    used = 0;
    for (int32_t k = 0; k < n; ++k) {
      Slot &s = slots[(size_t)slot_ids[k]];
      if (drafts[k] > 0) {
        accept(s, drafts[k], accepted[k]);
      } else if (drafts[k] == -1) {  // record_tree_acceptance: no calibration from trees
        s.last_gains.clear();
        num_accepted += accepted[k];
      }
      if (counts[k] >= 0) {
        add_tokens(s, tokens + used, counts[k]);
        used += counts[k];
      }
    }
  }

  bool make_walk(Slot &s, int64_t cap, Walk &w) {  // HistoDrafter._walk
    w.reset();
    if (cap <= 0) return false;
    PromptIndex &entry = *prompts.find(s.prompt)->second;
    int64_t num_tokens = (int64_t)s.seq.tokens.size();
    int n = 0;
    if (prepare(entry.index, s.seq.state, s.seq.match_len, cfg.match_len_prior, cfg.min_match_len, num_tokens,
                w.src[n]))
      ++n;
    if (s.has_glob) {  // RequestState.sources
      if (s.glob.flips != global->flips) global->follow_text(s.glob, s.seq.tokens, 0);
      for (size_t g = 0; g < global->gens.size(); ++g)
        if (prepare(*global->gens[g], s.glob.states[g], s.glob.lens[g], cfg.global_match_len_prior,
                    cfg.min_match_len, num_tokens, w.src[n]))
          ++n;
    }
    s.calibration_used = w.calibration = s.calibration();
    if (n == 0) return false;
    w.n = n;
    double gain = -1.0;
    for (int i = 0; i < n; ++i) gain = std::max(gain, (double)w.src[i].len / ((double)w.src[i].len + w.src[i].prior));
    w.gain = gain;
    w.cap = cap;
    w.stops = &s.stops;
    w.done = false;
    return true;
  }

  const int64_t *commit_block = nullptr;  // rhd_bind_commit's
  // rhd_bind's buffers and rhd_set_curve's curve.
  int64_t *bound_params = nullptr;
  int32_t bound_capacity = 0;
  int32_t *bound_tokens = nullptr, *bound_offsets = nullptr;
  double *bound_gains = nullptr;
  std::vector<double> curve_x, curve_y;
  std::vector<int32_t> sc_slots;

  double forward_ms(double t) const {  // cost_curve.CostCurve.forward_ms (t > 0)
    const std::vector<double> &xs = curve_x, &ys = curve_y;
    if (t < xs[0]) return ys[0];
    size_t i = (size_t)(std::upper_bound(xs.begin(), xs.end(), t) - xs.begin());  // bisect_right
    i = std::min(std::max<size_t>(i, 1), xs.size() - 1);
    double slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]);
    double v = ys[i - 1] + slope * (t - xs[i - 1]);
    return 1e-6 > v ? 1e-6 : v;
  }
  static int64_t round_half_even(double x) {  // Python's round() of a float in [0, 2^62)
    int64_t i = (int64_t)x;
    double frac = x - (double)i;
    return frac > 0.5 || (frac == 0.5 && (i & 1)) ? i + 1 : i;
  }
  double gain_threshold(int64_t num_seqs, double draft_per_seq_, double gain_per_seq_) const {  // budget.gain_threshold
    if (num_seqs <= 0) return 0.0;
    double want = (double)num_seqs * (1.0 + draft_per_seq_);
    if (!(want < 4e18)) invalid("num_seqs too large");
    int64_t num_tokens = std::max<int64_t>(1, round_half_even(want));
    double ms = forward_ms((double)num_tokens);
    double slope = (forward_ms((double)(num_tokens + 16)) - ms) / 16;
    return (slope > 0.0 ? slope : 0.0) * (double)num_seqs * (1.0 + gain_per_seq_) / ms;
  }
  void set_curve(const double *xs, const double *ys, int32_t num) {
    if (num < 0 || (num > 0 && (xs == nullptr || ys == nullptr)) || num == 1 || num > 4096)
      invalid("a cost curve needs 0 or 2..4096 points");
    for (int32_t k = 0; k < num; ++k) {
      if (!std::isfinite(xs[k]) || !std::isfinite(ys[k]) || !(ys[k] > 0.0)) invalid("curve point %lld is not finite and positive", k);
      if (k && !(xs[k] > xs[k - 1])) invalid("the curve's token counts must increase");
    }
    curve_x.assign(xs, xs + num);
    curve_y.assign(ys, ys + num);
  }
  // rhd_bind_trees's buffers: `tree_capacity` trees of at most `tree_node_cap` nodes.
  int32_t tree_capacity = 0;
  int64_t tree_node_cap = 0;
  int32_t *tree_tokens = nullptr, *tree_parents = nullptr, *tree_offsets = nullptr;
  double *tree_gains = nullptr;

  // The bound params block's header and slots (rhd_step and rhd_step_trees read the same).
  void read_params(int64_t capacity, int64_t &n, int64_t &budget, double &min_gain) {
    if (bound_params == nullptr) invalid("no buffers bound (rhd_bind)");
    n = bound_params[0];
    const int64_t num_seqs = bound_params[3];
    budget = bound_params[1];
    std::memcpy(&min_gain, &bound_params[2], sizeof min_gain);
    if (n < 0 || n > bound_capacity) invalid("%lld requests in one step, more than the %lld bound", n, bound_capacity);
    if (n > capacity) invalid("%lld requests in one step, more than the %lld bound", n, capacity);
    if (num_seqs < 0 || num_seqs > ((int64_t)1 << 31)) invalid("num_seqs %lld out of range", num_seqs);
    budget = budget == INT64_MIN ? -1 : std::min(std::max<int64_t>(budget, 0), (int64_t)1 << 62);
    sc_slots.resize((size_t)n);
    for (int64_t i = 0; i < n; ++i) {
      int64_t slot = bound_params[4 + i];
      if (slot < 0 || slot >= cfg.max_slots) invalid("slot %lld out of range [0, %lld)", slot, cfg.max_slots);
      sc_slots[(size_t)i] = (int32_t)slot;
    }
    if (!curve_x.empty()) {
      double threshold = gain_threshold(num_seqs ? num_seqs : n, draft_per_seq, gain_per_seq);
      if (threshold > min_gain) min_gain = threshold;
    }
  }
  void step() {  // rhd_step: propose over the bound buffers
    int64_t n, budget;
    double min_gain;
    read_params(bound_capacity, n, budget, min_gain);
    propose((int32_t)n, sc_slots.data(), bound_params + 4 + n, budget, min_gain, bound_tokens, bound_gains,
            bound_offsets + 1);
    bound_offsets[0] = 0;
    for (int64_t i = 0; i < n; ++i) bound_offsets[i + 1] += bound_offsets[i];
  }
  // rhd_step_trees: HistoDrafter.propose_trees's tree branch over the bound buffers (the
  // caller decides trees or linear drafts: tree, tree_max_batch), into the tree buffers.
  void step_trees(int64_t max_nodes, int64_t width) {
    if (tree_tokens == nullptr) invalid("no tree buffers bound (rhd_bind_trees)");
    if (width < 1 || width > ((int64_t)1 << 20)) invalid("tree width %lld out of range [1, 2^20]", width);
    const int64_t cap = std::min(max_nodes, cfg.max_draft_len * width);
    if (cap > tree_node_cap) invalid("%lld nodes per tree, more than the %lld bound", cap, tree_node_cap);
    int64_t n, budget;
    double min_gain;
    read_params(tree_capacity, n, budget, min_gain);
    propose((int32_t)n, sc_slots.data(), bound_params + 4 + n, budget, min_gain, tree_tokens, tree_gains,
            tree_offsets + 1, true, cap, width, tree_parents);
    tree_offsets[0] = 0;
    for (int64_t i = 0; i < n; ++i) tree_offsets[i + 1] += tree_offsets[i];
  }

  // Scratch of propose, reused from call to call: row i holds request i's draft.
  std::vector<int32_t> sc_tok, sc_len, sc_keep;
  std::vector<double> sc_gain, sc_bound, sc_ranked;
  std::vector<char> sc_has, sc_pending;

  // HistoDrafter.propose; with `tree`, propose_trees's trees of at most `tree_cap` nodes and
  // `width` children (the tree's parents to out_parents, back to back as the tokens).
  void propose(int32_t n, const int32_t *slot_ids, const int64_t *max_lens, int64_t budget, double min_gain,
               int32_t *out_tokens, double *out_gains, int32_t *out_lens, bool tree = false, int64_t tree_cap = 0,
               int64_t width = 1, int32_t *out_parents = nullptr) {
    if (n < 0 || (n > 0 && (slot_ids == nullptr || max_lens == nullptr || out_tokens == nullptr ||
                            out_gains == nullptr || out_lens == nullptr || (tree && out_parents == nullptr))))
      invalid("bad propose arrays");
    if (!(min_gain == min_gain)) invalid("min_gain is NaN");
    for (int32_t i = 0; i < n; ++i) live_slot(slot_ids[i]);
    const size_t K = (size_t)std::max<int64_t>(1, tree ? tree_cap : cfg.max_draft_len), N = (size_t)n;
    Params pp{cfg.smoothing, cfg.backoff, min_gain, cfg.min_match_len, cfg.neumaier, &scans};
    bool lazy = true;
    if (global)
      for (int32_t i = 0; i < n && lazy; ++i) {
        const Slot &s = slots[(size_t)slot_ids[i]];
        if (s.has_glob && s.glob.flips != global->flips) lazy = false;
      }
    if (walks.size() < N) walks.resize(N);
    sc_tok.resize(N * K);
    sc_gain.resize(N * K);
    sc_len.assign(N, 0);
    sc_bound.assign(N, 0.0);
    sc_has.assign(N, 0);
    if (tree && sc_parents.size() < N) sc_parents.resize(N);
    for (size_t i = 0; i < N; ++i) {
      Slot &s = slots[(size_t)slot_ids[i]];
      int64_t cap = std::min(max_lens[i], cfg.max_draft_len);
      if (tree) {  // each tree whole, in batch order (its sources may catch up with a global flip)
        sc_has[i] = make_walk(s, cap, walks[i]);
        s.calibration_used = s.calibration();
        if (sc_has[i]) {
          sc_bound[i] = walks[i].gain * 0.99;
          tree_walk.grow(walks[i], tree_cap, cap, width, pp, sc_parents[i]);
        }
        continue;
      }
      sc_has[i] = make_walk(s, cap, walks[i]);
      if (sc_has[i]) {
        sc_bound[i] = walks[i].gain * 0.99;
        if (!lazy) walks[i].materialize(pp);
      }
    }
    // budget.draft_within_budget
    int32_t t;
    double g;
    if (budget < 0) {
      for (size_t i = 0; i < N; ++i)
        if (sc_has[i])
          while (walks[i].step(pp, t, g)) {
            sc_tok[i * K + (size_t)sc_len[i]] = t;
            sc_gain[i * K + (size_t)sc_len[i]++] = g;
          }
    } else if (budget > 0) {
      typedef std::pair<double, int32_t> Key;
      std::priority_queue<Key, std::vector<Key>, std::greater<Key>> heap;
      for (size_t i = 0; i < N; ++i)
        if (sc_has[i]) heap.push(Key(-sc_bound[i], (int32_t)i));
      sc_pending.assign(N, 0);
      int64_t taken = 0;
      bool have_cut = false;
      double cut = 0.0;
      while (!heap.empty() && (!have_cut || -heap.top().first >= cut)) {
        Key key = heap.top();
        heap.pop();
        size_t i = (size_t)key.second;
        if (sc_pending[i]) {
          sc_pending[i] = 0;
          taken += 1;
          if (taken == budget) { have_cut = true; cut = -key.first; }
        }
        if (walks[i].step(pp, t, g)) {
          sc_tok[i * K + (size_t)sc_len[i]] = t;
          sc_gain[i * K + (size_t)sc_len[i]++] = g;
          sc_pending[i] = 1;
          heap.push(Key(-g, (int32_t)i));
        }
      }
      for (size_t i = 0; i < N; ++i)
        if (sc_pending[i]) --sc_len[i];
      trim_to_budget(N, K, budget);
    }
    // HistoDrafter._account, and the output
    int64_t num_tokens = 0, pos = 0;
    PySum total(cfg.neumaier);
    for (size_t i = 0; i < N; ++i) {
      Slot &s = slots[(size_t)slot_ids[i]];
      const int32_t len = sc_len[i];
      const double *gains = sc_gain.data() + i * K;
      s.last_gains.assign(gains, gains + len);
      out_lens[i] = len;
      std::copy(sc_tok.data() + i * K, sc_tok.data() + i * K + len, out_tokens + pos);
      std::copy(gains, gains + len, out_gains + pos);
      if (tree) std::copy(sc_parents[i].data(), sc_parents[i].data() + len, out_parents + pos);
      pos += len;
      num_tokens += len;
      if (len == 0) {
        num_empty += 1;
      } else {
        PySum inner(cfg.neumaier);
        for (int32_t k = 0; k < len; ++k) inner.add(gains[k]);
        total.add(inner.get());
      }
    }
    if (n) {
      draft_per_seq += EMA * ((double)num_tokens / (double)n - draft_per_seq);
      gain_per_seq += EMA * (total.get() / (double)n - gain_per_seq);
    }
    num_asked += n;
    num_draft_tokens += num_tokens;
  }

  void trim_to_budget(size_t N, size_t K, int64_t budget) {  // budget.trim_to_budget, over the rows
    int64_t total = 0;
    for (size_t i = 0; i < N; ++i) total += sc_len[i];
    if (total <= budget) return;
    sc_ranked.clear();
    for (size_t i = 0; i < N; ++i) sc_ranked.insert(sc_ranked.end(), &sc_gain[i * K], &sc_gain[i * K] + sc_len[i]);
    // the budget-th highest gain (what sorted(..., reverse=True)[budget - 1] reads)
    std::nth_element(sc_ranked.begin(), sc_ranked.begin() + (budget - 1), sc_ranked.end(), std::greater<double>());
    const double threshold = sc_ranked[(size_t)budget - 1];
    sc_keep.resize(N);
    int64_t kept = 0;
    for (size_t i = 0; i < N; ++i) {
      int32_t keep = 0;
      while (keep < sc_len[i] && sc_gain[i * K + (size_t)keep] > threshold) ++keep;
      kept += keep;
      sc_keep[i] = keep;
    }
    int64_t left = budget - kept;
    for (size_t i = 0; i < N; ++i) {
      int32_t keep = sc_keep[i];
      while (left > 0 && keep < sc_len[i] && sc_gain[i * K + (size_t)keep] >= threshold) { ++keep; --left; }
      sc_len[i] = keep;
    }
  }
};

// Runs f(drafter) inside the jump buffer (see Guard). The lambda and the frames below it hold
// no memory of their own when invalid() jumps; out_of_memory() may leak what they held.
template <class F>
int guarded(void *h, F &&f) {
  if (h == nullptr) return RHD_EINVAL;
  Drafter *d = static_cast<Drafter *>(h);
  if (d->broken) return RHD_ENOMEM;
  Guard guard;
  guard.error = d->error;
  guard.broken = &d->broken;
  Guard *outer = current;
  current = &guard;
  volatile int rc = 0;
  int jumped = setjmp(guard.env);
  if (jumped == 0) {
    rc = f(*d);
    d->publish();
  } else {
    rc = jumped == 1 ? RHD_ENOMEM : RHD_EINVAL;
  }
  current = outer;
  return rc;
}

}  // namespace

#define RHD_EXPORT extern "C" __attribute__((visibility("default")))

static void *create_drafter(const Config &c, double *stats);

RHD_EXPORT int rhd_abi_version(void) { return RHD_ABI_VERSION; }

RHD_EXPORT void *rhd_create(const int64_t *ci, int32_t num_i, const double *cd, int32_t num_d, double *stats) {
  if (ci == nullptr || cd == nullptr || stats == nullptr || num_i != RHD_CFG_I_COUNT || num_d != RHD_CFG_D_COUNT)
    return nullptr;
  Config c;
  c.use_history = ci[RHD_USE_HISTORY] != 0;
  c.use_siblings = ci[RHD_USE_SIBLINGS] != 0;
  c.use_prompt = ci[RHD_USE_PROMPT] != 0;
  c.use_global = ci[RHD_USE_GLOBAL] != 0;
  c.max_tokens_per_prompt = ci[RHD_MAX_TOKENS_PER_PROMPT];
  c.history_budget = ci[RHD_HISTORY_BUDGET];
  c.global_max_tokens = ci[RHD_GLOBAL_MAX_TOKENS];
  c.min_match_len = ci[RHD_MIN_MATCH_LEN];
  c.max_draft_len = ci[RHD_MAX_DRAFT_LEN];
  c.neumaier = ci[RHD_NEUMAIER_SUM] != 0;
  c.max_slots = ci[RHD_MAX_SLOTS];
  c.sibling_weight = cd[RHD_SIBLING_WEIGHT];
  c.prompt_weight = cd[RHD_PROMPT_WEIGHT];
  c.smoothing = cd[RHD_SMOOTHING];
  c.backoff = cd[RHD_BACKOFF_WEIGHT];
  c.match_len_prior = cd[RHD_MATCH_LEN_PRIOR];
  c.global_match_len_prior = cd[RHD_GLOBAL_MATCH_LEN_PRIOR];
  const int64_t limit = (int64_t)1 << 30;
  if (c.max_tokens_per_prompt < 16 || c.max_tokens_per_prompt > limit || c.global_max_tokens < 16 ||
      c.global_max_tokens > limit || c.history_budget < 0 || c.min_match_len < 1 || c.max_draft_len < 0 ||
      c.max_draft_len > 4096 || c.max_slots < 1 || c.max_slots > (1 << 24))
    return nullptr;
  for (int k = 0; k < RHD_CFG_D_COUNT; ++k)
    if (!std::isfinite(cd[k]) || cd[k] < 0.0) return nullptr;
  return create_drafter(c, stats);
}

static void *create_drafter(const Config &c, double *stats_arg) {
  double *volatile stats = stats_arg;
  void *volatile mem = malloc(sizeof(Drafter));
  if (mem == nullptr) return nullptr;
  char error[256];
  bool broken = false;
  Guard guard;
  guard.error = error;
  guard.broken = &broken;
  current = &guard;
  if (setjmp(guard.env) != 0) {  // out of memory while building it
    current = nullptr;
    free(mem);
    return nullptr;
  }
  Drafter *d = new (mem) Drafter(c, stats);
  current = nullptr;
  return d;
}

RHD_EXPORT void rhd_destroy(void *h) {  // made by malloc + placement new in create_drafter
  if (h == nullptr) return;
  static_cast<Drafter *>(h)->~Drafter();
  free(h);
}

RHD_EXPORT const char *rhd_last_error(void *h) {
  return h == nullptr ? "no drafter" : static_cast<Drafter *>(h)->error;
}

RHD_EXPORT int rhd_load_history(void *h, int64_t prompt, const int32_t *tokens, const int64_t *offsets, int32_t num,
                                const int32_t *ages, const double *weights) {
  return guarded(h, [&](Drafter &d) { d.load_history(prompt, tokens, offsets, num, ages, weights); return 0; });
}

RHD_EXPORT int rhd_add_global(void *h, const int32_t *tokens, const int64_t *offsets, int32_t num) {
  return guarded(h, [&](Drafter &d) { d.add_global(tokens, offsets, num); return 0; });
}

RHD_EXPORT int rhd_has_prompt(void *h, int64_t prompt) {
  return guarded(h, [&](Drafter &d) { return d.prompts.count(prompt) ? 1 : 0; });
}

RHD_EXPORT int rhd_release_prompt(void *h, int64_t prompt) {
  return guarded(h, [&](Drafter &d) { return d.release(prompt); });
}

RHD_EXPORT int rhd_start(void *h, int32_t slot, int64_t prompt, const int32_t *prompt_tokens, int64_t num_prompt,
                         const int32_t *generated, int64_t num_generated) {
  return guarded(h, [&](Drafter &d) {
    d.start(slot, prompt, prompt_tokens, num_prompt, generated, num_generated);
    return 0;
  });
}

RHD_EXPORT int rhd_stop(void *h, int32_t slot) {
  return guarded(h, [&](Drafter &d) { return d.stop(slot); });
}

RHD_EXPORT int rhd_set_stops(void *h, int32_t slot, const int32_t *stops, int32_t num) {
  return guarded(h, [&](Drafter &d) {
    Slot &s = d.live_slot(slot);
    if (num < 0 || (num > 0 && stops == nullptr)) invalid("bad stop token array");
    s.stops.assign(stops, stops + num);
    return 0;
  });
}

RHD_EXPORT int rhd_set_stops_many(void *h, int32_t n, const int32_t *slots, const int64_t *offsets,
                                  const int32_t *stops) {
  return guarded(h, [&](Drafter &d) {
    if (n < 0 || (n > 0 && (slots == nullptr || offsets == nullptr))) invalid("bad stop arrays");
    if (n == 0) return 0;
    if (offsets[0] != 0) invalid("offsets must start at 0");
    for (int32_t i = 0; i < n; ++i) {
      if (offsets[i + 1] < offsets[i]) invalid("offsets decrease at slot %lld", (long long)i);
      if (offsets[i + 1] - offsets[i] > INT32_MAX) invalid("slot %lld: too many stop tokens", (long long)i);
      d.live_slot(slots[i]);
    }
    if (offsets[n] > 0 && stops == nullptr) invalid("null stop token array");
    for (int32_t i = 0; i < n; ++i) d.slots[(size_t)slots[i]].stops.assign(stops + offsets[i], stops + offsets[i + 1]);
    return 0;
  });
}

RHD_EXPORT int rhd_commit(void *h, int32_t n, const int32_t *slots, const int32_t *drafts, const int32_t *accepted,
                          const int32_t *counts, const int32_t *tokens, int64_t num_tokens) {
  return guarded(h, [&](Drafter &d) { d.commit(n, slots, drafts, accepted, counts, tokens, num_tokens); return 0; });
}

RHD_EXPORT int rhd_propose(void *h, int32_t n, const int32_t *slots, const int64_t *max_lens, int64_t budget,
                           double min_gain, int32_t *out_tokens, double *out_gains, int32_t *out_lens) {
  return guarded(h, [&](Drafter &d) {
    d.propose(n, slots, max_lens, budget, min_gain, out_tokens, out_gains, out_lens);
    return 0;
  });
}

RHD_EXPORT int rhd_bind_commit(void *h, const int64_t *block) {
  return guarded(h, [&](Drafter &d) {
    if (block == nullptr) invalid("null commit block");
    d.commit_block = block;
    return 0;
  });
}
RHD_EXPORT int rhd_commit_bound(void *h) {
  return guarded(h, [&](Drafter &d) {
    const int64_t *b = d.commit_block;
    if (b == nullptr) invalid("no commit block bound (rhd_bind_commit)");
    if (b[0] < 0 || b[0] > INT32_MAX) invalid("%lld commit rows out of range", b[0]);
    auto at = [](int64_t address) { return reinterpret_cast<const int32_t *>((intptr_t)address); };
    d.commit((int32_t)b[0], at(b[1]), at(b[2]), at(b[3]), at(b[4]), at(b[5]), b[6]);
    return 0;
  });
}
RHD_EXPORT int rhd_bind(void *h, int64_t *params, int32_t capacity, int32_t *out_tokens, double *out_gains,
                        int32_t *out_offsets) {
  return guarded(h, [&](Drafter &d) {
    if (params == nullptr || out_tokens == nullptr || out_gains == nullptr || out_offsets == nullptr)
      invalid("null step buffer");
    if (capacity < 0 || capacity > d.cfg.max_slots) invalid("capacity %lld out of range [0, max_slots]", capacity);
    d.bound_params = params;
    d.bound_capacity = capacity;
    d.bound_tokens = out_tokens;
    d.bound_gains = out_gains;
    d.bound_offsets = out_offsets;
    return 0;
  });
}

RHD_EXPORT int rhd_step(void *h) {
  return guarded(h, [&](Drafter &d) { d.step(); return 0; });
}

RHD_EXPORT int rhd_bind_trees(void *h, int32_t capacity, int64_t max_nodes, int32_t *out_tokens, double *out_gains,
                              int32_t *out_parents, int32_t *out_offsets) {
  return guarded(h, [&](Drafter &d) {
    if (out_tokens == nullptr || out_gains == nullptr || out_parents == nullptr || out_offsets == nullptr)
      invalid("null tree buffer");
    if (capacity < 0 || capacity > d.cfg.max_slots) invalid("capacity %lld out of range [0, max_slots]", capacity);
    if (max_nodes < 1 || max_nodes > ((int64_t)1 << 31) / std::max<int64_t>(1, capacity))
      invalid("max_nodes %lld out of range (capacity * max_nodes < 2^31)", max_nodes);
    d.tree_capacity = capacity;
    d.tree_node_cap = max_nodes;
    d.tree_tokens = out_tokens;
    d.tree_gains = out_gains;
    d.tree_parents = out_parents;
    d.tree_offsets = out_offsets;
    return 0;
  });
}

RHD_EXPORT int rhd_step_trees(void *h, int64_t max_nodes, int64_t width) {
  return guarded(h, [&](Drafter &d) { d.step_trees(max_nodes, width); return 0; });
}

RHD_EXPORT int rhd_set_curve(void *h, const double *num_tokens, const double *ms, int32_t num) {
  return guarded(h, [&](Drafter &d) { d.set_curve(num_tokens, ms, num); return 0; });
}

RHD_EXPORT int rhd_gain_threshold(void *h, int64_t num_seqs, double draft_per_seq, double gain_per_seq,
                                  double *out) {
  return guarded(h, [&](Drafter &d) {
    if (out == nullptr || d.curve_x.empty()) invalid("no curve set, or a null output");
    if (!(draft_per_seq >= 0.0 && draft_per_seq < 1e9 && gain_per_seq >= 0.0 && gain_per_seq < 1e9) ||
        num_seqs > ((int64_t)1 << 31))
      invalid("statistics out of range");
    *out = d.gain_threshold(num_seqs, draft_per_seq, gain_per_seq);
    return 0;
  });
}

RHD_EXPORT int64_t rhd_memory_tokens(void *h, int64_t prompt) {
  if (h == nullptr) return RHD_EINVAL;
  if (static_cast<Drafter *>(h)->broken) return RHD_ENOMEM;
  Drafter *d = static_cast<Drafter *>(h);
  auto it = d->prompts.find(prompt);
  return it == d->prompts.end() ? 0 : it->second->num_tokens();
}

RHD_EXPORT int64_t rhd_memory_bytes(void *h, int64_t prompt) {
  if (h == nullptr) return RHD_EINVAL;
  Drafter *d = static_cast<Drafter *>(h);
  auto it = d->prompts.find(prompt);
  return it == d->prompts.end() ? 0 : it->second->bytes();
}

RHD_EXPORT int64_t rhd_global_tokens(void *h) {
  if (h == nullptr) return RHD_EINVAL;
  Drafter *d = static_cast<Drafter *>(h);
  return d->global ? d->global->num_tokens() : 0;
}

RHD_EXPORT int64_t rhd_global_bytes(void *h) {
  if (h == nullptr) return RHD_EINVAL;
  Drafter *d = static_cast<Drafter *>(h);
  return d->global ? d->global->bytes() : 0;
}

RHD_EXPORT int rhd_prompt_totals(void *h, int64_t *out) {
  return guarded(h, [&](Drafter &d) {
    if (out == nullptr) invalid("null output");
    int64_t tokens = 0;
    for (auto &p : d.prompts) tokens += p.second->num_tokens();
    out[0] = (int64_t)d.prompts.size();
    out[1] = tokens;
    return 0;
  });
}
