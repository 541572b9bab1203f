#pragma once
// An in-memory transport for the engine's unit tests: a queue of messages per peer, filled by
// the test; sends vanish.
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace fastcomm {

struct FakeTransport final : Transport {
  struct Rec {
    Header hdr;
    std::vector<uint8_t> data;
  };
  std::vector<std::deque<Rec>> in;
  std::vector<char> alive;
  Message cur;
  std::vector<uint64_t> drained;  // tags of the offers drained

  explicit FakeTransport(int world) : in(world), alive(world, 1) {}
  const char* name() const override { return "fake"; }
  size_t max_payload() const override { return 1024; }
  bool try_send(int, const Header&, const void*) override { return true; }
  void flush() override {}
  const Message* peek(int peer) override {
    if (in[peer].empty()) return nullptr;
    cur.hdr = in[peer].front().hdr;
    cur.data = in[peer].front().data.data();
    return &cur;
  }
  void pop(int peer) override { in[peer].pop_front(); }
  bool peer_alive(int peer) override { return alive[peer] != 0; }
  void drain_bulk(int, const Message& offer) override { drained.push_back(offer.hdr.tag); }

  void deliver(int peer, const Header& hdr, const void* data) {
    Rec r;
    r.hdr = hdr;
    const uint8_t* p = static_cast<const uint8_t*>(data);
    r.data.assign(p, p + hdr.len);
    in[peer].push_back(std::move(r));
  }
  void deliver(int peer, uint64_t group, uint64_t seq, uint32_t tag, const std::string& payload,
               uint8_t flags = 0) {
    Header h;
    h.group = group;
    h.seq = seq;
    h.tag = tag;
    h.flags = flags;
    h.len = (uint32_t)payload.size();
    deliver(peer, h, payload.data());
  }
};

}  // namespace fastcomm
