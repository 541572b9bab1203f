#include "engine/group.h"

#include <algorithm>
#include <sstream>

#include "transport/transport_set.h"

namespace fastcomm {

namespace {

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

std::string ranks_label(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  os << "]";
  return os.str();
}

std::string GroupHandle::label() const { return ranks_label(ranks); }

GroupRegistry::GroupRegistry(uint64_t engine_serial, int rank, std::vector<int> host_of, bool hierarchical)
    : serial_(engine_serial), rank_(rank), host_of_(std::move(host_of)), hierarchical_(hierarchical) {}

std::vector<GroupHandle> GroupRegistry::create(const std::vector<std::vector<int>>& lists, TransportSet& tr,
                                               std::chrono::milliseconds timeout) {
  const int me = rank_, W = (int)host_of_.size();
  std::vector<GroupHandle> out;
  out.reserve(lists.size());
  for (const auto& given : lists) {
    std::vector<int> ranks = given;
    std::sort(ranks.begin(), ranks.end());
    const std::string label = ranks_label(given);
    TORCH_CHECK_VALUE(!ranks.empty(), "fastcomm.new_group: rank ", me, ": argument 'ranks' is empty");
    for (size_t i = 0; i < ranks.size(); ++i) {
      TORCH_CHECK_VALUE(ranks[i] >= 0 && ranks[i] < W, "fastcomm.new_group: rank ", me, ": argument 'ranks' ",
                        label, " holds rank ", ranks[i], ", outside the world of size ", W);
      TORCH_CHECK_VALUE(i == 0 || ranks[i] != ranks[i - 1], "fastcomm.new_group: rank ", me,
                        ": argument 'ranks' ", label, " lists rank ", ranks[i], " twice");
    }
    GroupHandle h;
    h.ranks = ranks;
    auto it = std::find(ranks.begin(), ranks.end(), me);
    if (it == ranks.end()) {
      out.push_back(std::move(h));  // not a member: nothing to create
      continue;
    }
    for (int r : ranks)
      TORCH_CHECK(tr.reaches(r), "fastcomm.new_group: rank ", me, ": group ", ranks_label(ranks),
                  " spans hosts (rank ", r, " is on another host) but this engine has no Gloo transport");
    const uint32_t instance = instances_[ranks]++;
    uint64_t id = mix64(0x66636f6dULL ^ ranks.size());
    for (int r : ranks) id = mix64(id ^ (uint64_t)r);
    id = mix64(id ^ ((uint64_t)instance << 32));
    TORCH_INTERNAL_ASSERT(groups_.count(id) == 0, "group id collision");
    auto st = std::make_shared<GroupState>();
    st->engine = serial_;
    st->id = id;
    st->ranks = ranks;
    st->rank = (int)(it - ranks.begin());
    st->label = ranks_label(ranks);
    st->hosts = host_layout(ranks);
    st->timeout = timeout;
    groups_[id] = st;
    h.rank = st->rank;
    h.id = id;
    h.state = st;
    out.push_back(std::move(h));
  }
  return out;
}

GroupHandle GroupRegistry::channel(const GroupHandle& g, int src, int dst, int tag) {
  auto key = std::make_tuple(g.id, src, dst, tag);
  auto it = channels_.find(key);
  if (it != channels_.end()) return it->second;
  auto st = std::make_shared<GroupState>();
  st->engine = serial_;
  st->ranks = {std::min(src, dst), std::max(src, dst)};
  st->rank = st->ranks[0] == rank_ ? 0 : 1;
  st->label = g.label() + " (" + std::to_string(src) + "->" + std::to_string(dst) + ", tag " +
              std::to_string(tag) + ")";
  st->timeout = g.state->timeout;
  st->id = mix64(mix64(mix64(mix64(g.id ^ 0x7032705ULL) ^ (uint64_t)src) ^ (uint64_t)dst) ^ (uint64_t)(uint32_t)tag);
  groups_[st->id] = st;
  GroupHandle h;
  h.ranks = st->ranks;
  h.rank = st->rank;
  h.id = st->id;
  h.state = st;
  channels_[key] = h;
  return h;
}

RecvPort* GroupRegistry::port(const std::shared_ptr<GroupState>& st, int tag) {
  auto& slot = ports_[{st->id, tag}];
  if (slot) return slot.get();
  GroupHandle g;
  g.ranks = st->ranks;
  g.rank = st->rank;
  g.id = st->id;
  g.state = st;
  auto port = std::make_unique<RecvPort>();
  port->group = g.state;
  port->tag = tag;
  port->from.resize(g.ranks.size(), nullptr);
  for (size_t i = 0; i < g.ranks.size(); ++i)
    if (g.ranks[i] != rank_) port->from[i] = channel(g, g.ranks[i], rank_, tag).state.get();
  slot = std::move(port);
  return slot.get();
}

// Null unless the group spans hosts with several members on one of them: with one host there
// is no Gloo at all, and with a member per host the flat exchange is already one message per
// pair of hosts.
std::shared_ptr<const HostLayout> GroupRegistry::host_layout(const std::vector<int>& ranks) const {
  if (!hierarchical_) return nullptr;
  auto L = std::make_shared<HostLayout>();
  L->leader.resize(ranks.size());
  std::unordered_map<int, int> leader_of_host;  // host index -> its lowest group rank
  for (int i = 0; i < (int)ranks.size(); ++i) {
    auto it = leader_of_host.emplace(host_of_[ranks[i]], i).first;
    L->leader[i] = it->second;
    if (it->second == i) L->leaders.push_back(i);
  }
  if (L->leaders.size() < 2 || L->leaders.size() == ranks.size()) return nullptr;
  return L;
}

void GroupRegistry::clear() {
  ports_.clear();
  groups_.clear();
  channels_.clear();
}

}  // namespace fastcomm
