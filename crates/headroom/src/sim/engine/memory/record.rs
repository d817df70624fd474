//! The requests a step makes of the device, recorded so that a step known to make the same
//! ones (see `sim::memo`) can make them again without the tracer: recording them as the
//! allocator serves them, and making them again.

use headroom_alloc::BlockId;

use super::{Allocation, Memory};
use crate::sim::engine::component::Component;

/// One request a step made of the device, recorded so that a step known to make the same
/// requests can make them again without the tracer (see `sim::memo`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Request {
    /// On `stream` (a collective's own, or the default one).
    Malloc {
        bytes: u64,
        stream: u32,
        component: Component,
        label: &'static str,
    },
    /// Free what the `index`th `Malloc` of the record allocated.
    Free { index: u32, label: &'static str },
    /// Charge what the `index`th `Malloc` of the record allocated to `component`.
    Recategorize { index: u32, component: Component },
}

/// Requests being recorded.
pub(super) struct Recording {
    pub(super) requests: Vec<Request>,
    /// How many requests of the record come before `requests`, kept by the caller (see
    /// `Memory::replay_as_recorded`).
    before: usize,
    mallocs: u32,
    /// By block index: the `Malloc` whose allocation the block holds, `BEFORE` for a block
    /// allocated before the recording started (or free).
    by_block: Vec<u32>,
    /// Every request refers to allocations of the record only, and the run did not stop.
    complete: bool,
}

const BEFORE: u32 = u32::MAX;

impl Recording {
    /// Out of line: the allocation paths stay small for the steps that record nothing.
    #[inline(never)]
    pub(super) fn malloc(
        &mut self,
        block: BlockId,
        bytes: u64,
        stream: u32,
        component: Component,
        label: &'static str,
    ) {
        self.requests.push(Request::Malloc {
            bytes,
            stream,
            component,
            label,
        });
        if self.by_block.len() <= block.index() {
            self.by_block.resize(block.index() + 1, BEFORE);
        }
        self.by_block[block.index()] = self.mallocs;
        self.mallocs += 1;
    }

    #[inline(never)]
    pub(super) fn free(&mut self, block: BlockId, label: &'static str) {
        if let Some(index) = self.index_of(block, true) {
            self.requests.push(Request::Free { index, label });
        }
    }

    /// The run stopped while recording: the record is never made again.
    pub(super) fn abandon(&mut self) {
        self.complete = false;
    }

    /// The `Malloc` behind `block` (freed now if `free`), or `None` (the record is then
    /// incomplete).
    pub(super) fn index_of(&mut self, block: BlockId, free: bool) -> Option<u32> {
        let slot = self.by_block.get_mut(block.index());
        let index = match slot {
            Some(index) if *index != BEFORE => {
                let found = *index;
                if free {
                    *index = BEFORE;
                }
                Some(found)
            }
            _ => None,
        };
        self.complete &= index.is_some();
        index
    }
}

impl Memory {
    /// Starts recording requests. Room is made for as many as were made so far (a step makes
    /// about as many as the one before): growing the record by copying costs more than
    /// writing it.
    pub(crate) fn record_requests(&mut self) {
        let counts = &self.allocator.stats().allocation.all;
        let so_far = (counts.allocated + counts.freed) as usize;
        self.recording = Some(Recording {
            requests: Vec::with_capacity(so_far),
            before: 0,
            mallocs: 0,
            by_block: Vec::new(),
            complete: true,
        });
    }

    /// `a`, the allocation just made, is one the process makes once (a cuBLAS workspace at its
    /// first GEMM): the record leaves it out. Requests are made again only from a state
    /// where it was made already, so a replay must not make it; a request that frees it
    /// refers to an allocation from before the record.
    pub(crate) fn made_once(&mut self, a: &Allocation) {
        if let Some(r) = &mut self.recording
            && let Some(slot) = r.by_block.get_mut(a.block.index())
            && r.mallocs.checked_sub(1) == Some(*slot)
            && let Some(Request::Malloc { .. }) = r.requests.last()
        {
            r.requests.pop();
            r.mallocs -= 1;
            *slot = BEFORE;
        }
    }

    /// The recorded `Malloc` whose allocation `a` is, if it was recorded.
    pub(crate) fn recorded_malloc(&self, a: &Allocation) -> Option<u32> {
        let r = self.recording.as_ref()?;
        r.by_block
            .get(a.block.index())
            .copied()
            .filter(|&i| i != BEFORE)
    }

    /// Requests recorded so far (0 when not recording).
    pub(crate) fn requests_recorded(&self) -> usize {
        self.recording
            .as_ref()
            .map_or(0, |r| r.before + r.requests.len())
    }

    /// Whether a record is being made that has nothing of its own yet: requests replayed
    /// now with `replay_as_recorded` are its first.
    pub(crate) fn record_is_empty(&self) -> bool {
        self.recording
            .as_ref()
            .is_some_and(|r| r.before == 0 && r.requests.is_empty())
    }

    /// `replay` of requests the caller keeps as the start of the record being made (it must
    /// be empty or hold only such requests): they count as recorded, indices and all, but are
    /// not copied into it. What they leave allocated that later requests free or recharge
    /// must be `adopt`ed.
    pub(crate) fn replay_as_recorded(
        &mut self,
        requests: &[Request],
        allocations: &mut Vec<Allocation>,
    ) {
        let recording = self.recording.take();
        debug_assert!(recording.as_ref().is_none_or(|r| r.requests.is_empty()));
        let first = allocations.len();
        self.replay(requests, allocations);
        self.recording = recording.map(|mut r| {
            r.before += requests.len();
            r.mallocs += (allocations.len() - first) as u32;
            // A run that stopped replays nothing more than the records had.
            r.complete &= self.stopped.is_none();
            r
        });
    }

    /// `a`, made by the record's `index`th `Malloc` in a `replay_as_recorded`, is still live:
    /// later requests may refer to it.
    pub(crate) fn adopt(&mut self, index: u32, a: &Allocation) {
        if let Some(r) = &mut self.recording {
            if r.by_block.len() <= a.block.index() {
                r.by_block.resize(a.block.index() + 1, BEFORE);
            }
            r.by_block[a.block.index()] = index;
        }
    }

    /// Stops recording: the requests, if they refer to allocations of the record only (those
    /// the caller kept from `replay_as_recorded` are not among them).
    pub(crate) fn take_requests(&mut self) -> Option<Vec<Request>> {
        self.recording
            .take()
            .filter(|r| r.complete)
            .map(|r| r.requests)
    }

    /// Makes `requests` again, each allocation on the stream it was made on; `allocations`
    /// holds those of the record's `Malloc`s made so far (the record's indices), to be
    /// continued by a later call.
    pub(crate) fn replay(&mut self, requests: &[Request], allocations: &mut Vec<Allocation>) {
        let current = self.stream;
        for &request in requests {
            match request {
                Request::Malloc {
                    bytes,
                    stream,
                    component,
                    label,
                } => {
                    self.stream = stream;
                    allocations.push(self.malloc(bytes, component, label));
                }
                Request::Free { index, label } => self.free(allocations[index as usize], label),
                Request::Recategorize { index, component } => {
                    self.recategorize(&mut allocations[index as usize], component)
                }
            }
        }
        self.stream = current;
    }
}
