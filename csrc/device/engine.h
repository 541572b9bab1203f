#pragma once
// The device engine: collectives on device tensors over per-peer channels, on any Runtime
// (device/runtime.h). What it promises is the host engine's: ops of different groups, of
// overlapping groups and from several threads may be issued in any order without deadlock; ops
// of one group run in issue order; a dead or stalled peer fails only the ops that need it.
//
// How it keeps that on devices, whose communicators run their work in issue order:
// - Channels. Each pair of ranks that shares an op gets a two-rank communicator on a stream of
//   its own, made at the pair's first op; its id travels over the host engine's control path
//   (HostLink), not a world collective. A group's op is one part per peer it exchanges with.
// - Agreed order. The pair's lower rank proposes each part once its op is ready; the other
//   commits the proposals it has a matching op for, in the order they become ready here, and
//   both launch in commit order. The proposal carries the op's signature, so a member that
//   issued something else fails the op on both sides instead of mixing data.
// - Nothing waits on work enqueued after it. An op is ready once the previous op of its group
//   is enqueued (pipelined, not run); its transfers wait for its inputs and that op's end, both
//   enqueued before it was committed, and its end work follows its own transfers. So every
//   cross-stream wait points at work committed or enqueued earlier, and each channel is a FIFO
//   both sides fill alike (docs/design.md has the argument).
// - Stream semantics. A blocking call and Work.wait() return once the op is enqueued, with the
//   caller's stream ordered after it; the host never waits for the device.
// - Faults. Every runtime call on a communicator is made by the engine's one thread, so an
//   abort never races another call. A deadline per op, the host's liveness of peers, a failed
//   control message or the communicator's asynchronous error abort that peer's channel only
//   and fail the ops that needed it with DistBackendError naming the peer.
//
// The (n-1)x exchange of a group of n members is this engine's only algorithm: it suits the
// small groups fastcomm is for.
#include "device/runtime.h"
#include "engine/device.h"
