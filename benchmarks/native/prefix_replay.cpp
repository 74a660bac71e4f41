// The radix tree alone on benchmarks/prefix.py's shared-prefix trace (64 groups x 16 prompts of a
// 2,048-token system prompt + a 128-token question, shuffled, in waves of 16: match the wave, then
// insert it), without Python: for A/B tests of the tree's code, whose effects of 5-20% the Python
// benchmark's run-to-run noise hides.
//
// Between waves the machine may sit idle for a while (--idle-us): on a shared machine other tenants
// of the L3 evict the tree within about a millisecond, which is the state a match finds it in between
// a server's scheduling steps. Each form (one match call per request, or one match_ragged call per
// wave) takes turns with the others, replay by replay; each keeps its best and median replay.
//
//   make bench-prefix-replay                                  # builds and runs with the defaults
//   build/bench-native/prefix_replay --idle-us 0,1000 --replays 9
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "prefix/radix_tree.h"

namespace {

using kvcache::prefix::BlockAllocator;
using kvcache::prefix::Ragged;
using kvcache::prefix::RadixTree;
using Clock = std::chrono::steady_clock;

constexpr int kPage = 16, kWave = 16, kVocab = 32000;

std::vector<std::vector<int32_t>> make_trace(int groups, int per_group) {
  std::mt19937 rng(0);
  std::vector<std::vector<int32_t>> requests;
  for (int g = 0; g < groups; ++g) {
    std::vector<int32_t> system(2048);
    for (int32_t& t : system) t = static_cast<int32_t>(rng() % kVocab);
    for (int p = 0; p < per_group; ++p) {
      std::vector<int32_t> r = system;
      for (int q = 0; q < 128; ++q) r.push_back(static_cast<int32_t>(rng() % kVocab));
      requests.push_back(std::move(r));
    }
  }
  std::shuffle(requests.begin(), requests.end(), rng);
  return requests;
}

void idle(int64_t us) {  // busy, touching no memory: whatever leaves the caches meanwhile, others evicted
  const auto until = Clock::now() + std::chrono::microseconds(us);
  while (Clock::now() < until) {
  }
}

/// Nanoseconds per request of the timed matches of one replay.
double replay(const std::vector<std::vector<int32_t>>& trace, bool batched, int64_t idle_us, int64_t* checksum) {
  const int64_t pages = (static_cast<int64_t>(trace[0].size()) + kPage - 1) / kPage;
  auto alloc = std::make_shared<BlockAllocator>(static_cast<int64_t>(trace.size()) * pages, kPage);
  auto tree = RadixTree::create(alloc);
  std::vector<int32_t> blocks;
  double seconds = 0;
  for (size_t w = 0; w < trace.size(); w += kWave) {
    const size_t n = std::min<size_t>(kWave, trace.size() - w);
    // The wave arrives: its token arrays (fresh, as a tokenizer just wrote them) and its blocks.
    std::vector<int32_t> flat;
    std::vector<int64_t> cu{0};
    for (size_t i = w; i < w + n; ++i) {
      flat.insert(flat.end(), trace[i].begin(), trace[i].end());
      cu.push_back(static_cast<int64_t>(flat.size()));
    }
    std::vector<std::vector<int32_t>> own;
    for (size_t i = 0; i < n; ++i) own.push_back(alloc->allocate(pages));
    idle(idle_us);
    std::vector<int64_t> lengths(n), nodes(n), cu_blocks(n + 1);
    blocks.clear();
    const auto t0 = Clock::now();
    if (batched) {
      tree->match_ragged("bench", Ragged{flat.data(), static_cast<int64_t>(flat.size()), cu.data(), static_cast<int64_t>(n)},
                         false, lengths.data(), &blocks, cu_blocks.data(), nodes.data());
    } else {
      for (size_t i = 0; i < n; ++i) {
        blocks.clear();
        lengths[i] = tree->match_into("bench", flat.data() + cu[i], cu[i + 1] - cu[i], false, &blocks, &nodes[i]);
      }
    }
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    for (size_t i = 0; i < n; ++i) {
      *checksum += lengths[i];
      tree->insert("bench", flat.data() + cu[i], cu[i + 1] - cu[i], own[i].data(), pages);
      alloc->free(own[i].data(), pages);
    }
  }
  return seconds / static_cast<double>(trace.size()) * 1e9;
}

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p) break;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> idle_us{0, 1000, 3000};
  int replays = 7, groups = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--idle-us")) {
      idle_us = parse_list(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--replays")) {
      replays = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--groups")) {
      groups = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "usage: %s [--idle-us 0,1000,3000] [--replays 7] [--groups 64]\n", argv[0]);
      return 2;
    }
  }
  const auto trace = make_trace(groups, 16);
  std::printf("radix tree, shared-prefix trace (%zu requests of %zu tokens, waves of %d, pages of %d), ns per request;"
              " best / median of %d replays\n", trace.size(), trace[0].size(), kWave, kPage, replays);
  std::printf("| idle between waves | match per call | match_ragged per wave |\n|---|---|---|\n");
  int64_t checksum = 0;
  for (int64_t us : idle_us) {
    std::vector<double> runs[2];
    for (int r = 0; r < replays; ++r) {
      for (int batched = 0; batched < 2; ++batched) runs[batched].push_back(replay(trace, batched, us, &checksum));
    }
    std::printf("| %lld us |", static_cast<long long>(us));
    for (auto& v : runs) {
      std::sort(v.begin(), v.end());
      std::printf(" %.0f / %.0f |", v.front(), v[v.size() / 2]);
    }
    std::printf("\n");
  }
  std::printf("(matched tokens, all replays: %lld)\n", static_cast<long long>(checksum));
  return 0;
}
