//! The device side of the timeline: every tensor allocation goes through the caching-allocator
//! simulator, so allocated bytes are block sizes (as `torch.cuda.max_memory_allocated` counts
//! them) and reserved bytes are segments. On top, it keeps what PyTorch does not: which
//! component each byte belongs to, and the breakdown at the peak.

use headroom_alloc::{BlockId, CachingAllocator, OutOfMemory};

use super::component::Component;

/// One live allocation. Its block's address and size are the allocator's (fixed while it is
/// allocated); kept to 16 bytes, it is returned in registers and keeps tensor records small.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Allocation {
    requested: u64,
    block: BlockId,
    component: Component,
}

/// A recorded allocation or free, for comparing a timeline with a real trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    pub alloc: bool,
    pub bytes: u64,
    pub component: Component,
    pub label: &'static str,
}

/// The peak of one measured phase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhasePeak {
    pub step: u32,
    pub phase: &'static str,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
}

/// The largest allocated total seen so far and what it was made of.
#[derive(Clone, Debug, Default)]
pub struct PeakRecord {
    pub allocated: u64,
    pub breakdown: [u64; Component::COUNT],
    /// Where the step was when the peak happened (phase and step number).
    pub phase: &'static str,
    pub step: u32,
}

/// The first allocation the device could not satisfy: where it happened and PyTorch's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimulatedOom {
    pub step: u32,
    pub phase: &'static str,
    /// What was being allocated (the timeline's label for the tensor).
    pub tensor: &'static str,
    pub requested_bytes: u64,
    /// The simulator's `torch.OutOfMemoryError`; its `Display` is PyTorch 2.11's message.
    pub error: OutOfMemory,
}

/// One request a step made of the device, recorded so that a step known to make the same
/// requests can make them again without the tracer (see `step.rs`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Request {
    Malloc {
        bytes: u64,
        component: Component,
        label: &'static str,
    },
    /// Free what the `index`th `Malloc` of the record allocated.
    Free { index: u32, label: &'static str },
    /// Charge what the `index`th `Malloc` of the record allocated to `component`.
    Recategorize { index: u32, component: Component },
}

/// Requests being recorded.
struct Recording {
    requests: Vec<Request>,
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
    fn malloc(&mut self, block: BlockId, bytes: u64, component: Component, label: &'static str) {
        self.requests.push(Request::Malloc {
            bytes,
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
    fn free(&mut self, block: BlockId, label: &'static str) {
        if let Some(index) = self.index_of(block, true) {
            self.requests.push(Request::Free { index, label });
        }
    }

    /// The `Malloc` behind `block` (freed now if `free`), or `None` (the record is then
    /// incomplete).
    fn index_of(&mut self, block: BlockId, free: bool) -> Option<u32> {
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

/// What a run does after its first out-of-memory error (which is recorded in any case).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnOom {
    /// Lift the device limit and go on: the timeline stays complete, if no longer physical.
    GoOn,
    /// Stop: nothing more reaches the allocator (the caller only wants to know where).
    Stop,
    /// Stop unless the run is still what it would be without a device limit
    /// ([`Memory::unlimited`]): then it goes on as that run, whose numbers the caller wants
    /// next, so that it need not be simulated again.
    StopUnlessUnlimited,
}

pub(crate) struct Memory {
    pub(crate) allocator: CachingAllocator,
    oom: Option<SimulatedOom>,
    /// What the first out-of-memory error does to the run.
    on_oom: OnOom,
    /// Stopped: from here on nothing reaches the allocator; allocations carry this block
    /// (the last one made) and are never freed.
    stopped: Option<BlockId>,
    live: [u64; Component::COUNT],
    peak: PeakRecord,
    phase: &'static str,
    step: u32,
    phase_peak: u64,
    trace: Option<Vec<TraceEvent>>,
    /// The current CUDA stream: a block is served from, and returns to, the pool of the
    /// stream it was allocated on (collectives allocate on their own streams).
    pub(crate) stream: u32,
    recording: Option<Recording>,
}

impl Memory {
    pub(crate) fn new(allocator: CachingAllocator, record_trace: bool) -> Self {
        Memory {
            allocator,
            oom: None,
            on_oom: OnOom::GoOn,
            stopped: None,
            live: [0; Component::COUNT],
            peak: PeakRecord::default(),
            phase: "load",
            step: 0,
            phase_peak: 0,
            trace: record_trace.then(Vec::new),
            stream: 0,
            recording: None,
        }
    }

    pub(crate) fn allocated(&self) -> u64 {
        self.allocator.stats().allocated_bytes.all.current as u64
    }

    /// `torch.cuda.reset_peak_memory_stats()` at the start of a measured phase.
    /// Name what is allocated from here on (and an out-of-memory error) after a phase.
    pub(crate) fn start_phase(&mut self, phase: &'static str, step: u32) {
        self.phase = phase;
        self.step = step;
        self.phase_peak = self.allocated();
    }

    /// A measured phase starts: [`Memory::start_phase`], then `reset_peak_memory_stats()`.
    pub(crate) fn begin_measured_phase(&mut self, phase: &'static str, step: u32) {
        self.start_phase(phase, step);
        self.allocator.reset_peak_stats();
    }

    /// The running phase's peaks, as `max_memory_allocated()` and `max_memory_reserved()`
    /// read them.
    pub(crate) fn phase_peak(&self) -> PhasePeak {
        PhasePeak {
            step: self.step,
            phase: self.phase,
            peak_allocated: self.phase_peak,
            peak_reserved: self.allocator.stats().reserved_bytes.all.peak as u64,
        }
    }

    pub(crate) fn malloc(
        &mut self,
        bytes: u64,
        component: Component,
        label: &'static str,
    ) -> Allocation {
        if let Some(block) = self.stopped {
            if let Some(r) = &mut self.recording {
                r.complete = false;
            }
            return Allocation {
                block,
                requested: bytes,
                component,
            };
        }
        let block = match self.allocator.malloc(bytes, self.stream) {
            Ok(block) => block,
            Err(err) => {
                // PyTorch raises here. The rest of the run goes on without a limit so that the
                // caller still gets a complete (if no longer physical) timeline.
                if self.oom.is_none() {
                    self.oom = Some(SimulatedOom {
                        step: self.step,
                        phase: self.phase,
                        tensor: label,
                        requested_bytes: bytes,
                        error: err,
                    });
                }
                self.allocator.set_capacity(None);
                let block = self
                    .allocator
                    .malloc(bytes, self.stream)
                    .expect("an allocator without a capacity limit does not run out");
                let stop = match self.on_oom {
                    OnOom::GoOn => false,
                    OnOom::Stop => true,
                    OnOom::StopUnlessUnlimited => !self.unlimited(),
                };
                if stop {
                    self.stopped = Some(block);
                }
                block
            }
        };
        let block_size = self.allocator.block_size(block);
        if let Some(r) = &mut self.recording {
            r.malloc(block, bytes, component, label);
        }
        self.live[component.index()] += bytes;
        self.live[Component::AllocatorRounding.index()] += block_size - bytes;
        if let Some(trace) = &mut self.trace {
            trace.push(TraceEvent {
                alloc: true,
                bytes,
                component,
                label,
            });
        }
        let allocated = self.allocated();
        self.phase_peak = self.phase_peak.max(allocated);
        // The peak that matters is that of the measured steps; loading is a phase of its own.
        if self.phase != "load" && allocated > self.peak.allocated {
            self.peak = PeakRecord {
                allocated,
                breakdown: self.live,
                phase: self.phase,
                step: self.step,
            };
        }
        Allocation {
            block,
            requested: bytes,
            component,
        }
    }

    /// What a live allocation is, block handles aside: (block address, requested bytes,
    /// block size, component).
    pub(crate) fn signature(&self, a: &Allocation) -> (u64, u64, u64, Component) {
        (
            self.allocator.block_address(a.block),
            a.requested,
            self.allocator.block_size(a.block),
            a.component,
        )
    }

    #[inline]
    pub(crate) fn free(&mut self, a: Allocation, label: &'static str) {
        if self.stopped.is_some() {
            return;
        }
        if let Some(r) = &mut self.recording {
            r.free(a.block, label);
        }
        let block_size = self.allocator.block_size(a.block);
        self.allocator.free(a.block);
        self.live[a.component.index()] -= a.requested;
        self.live[Component::AllocatorRounding.index()] -= block_size - a.requested;
        if let Some(trace) = &mut self.trace {
            trace.push(TraceEvent {
                alloc: false,
                bytes: a.requested,
                component: a.component,
                label,
            });
        }
    }

    /// Move an allocation's bytes to another component (a gradient that becomes `.grad`).
    pub(crate) fn recategorize(&mut self, a: &mut Allocation, component: Component) {
        if self.stopped.is_some() {
            return;
        }
        if let Some(r) = &mut self.recording
            && let Some(index) = r.index_of(a.block, false)
        {
            r.requests.push(Request::Recategorize { index, component });
        }
        self.live[a.component.index()] -= a.requested;
        self.live[component.index()] += a.requested;
        a.component = component;
    }

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

    /// Makes `requests` again; `allocations` holds those of the record's `Malloc`s made so
    /// far (the record's indices), to be continued by a later call.
    pub(crate) fn replay(&mut self, requests: &[Request], allocations: &mut Vec<Allocation>) {
        for &request in requests {
            match request {
                Request::Malloc {
                    bytes,
                    component,
                    label,
                } => allocations.push(self.malloc(bytes, component, label)),
                Request::Free { index, label } => self.free(allocations[index as usize], label),
                Request::Recategorize { index, component } => {
                    self.recategorize(&mut allocations[index as usize], component)
                }
            }
        }
    }

    /// Bytes requested by live allocations, per component.
    pub(crate) fn live(&self) -> [u64; Component::COUNT] {
        self.live
    }

    /// Events recorded so far (when recording).
    pub(crate) fn trace_len(&self) -> usize {
        self.trace.as_ref().map_or(0, Vec::len)
    }

    /// Records again the events `range` recorded earlier (a step that repeats another).
    pub(crate) fn repeat_trace(&mut self, range: std::ops::Range<usize>) {
        if let Some(trace) = &mut self.trace {
            trace.extend_from_within(range);
        }
    }

    pub(crate) fn peak(&self) -> &PeakRecord {
        &self.peak
    }

    /// What the first out-of-memory error does from now on.
    pub(crate) fn on_oom(&mut self, policy: OnOom) {
        self.on_oom = policy;
    }

    /// Whether the allocator is where the same requests would have left it without a device
    /// limit, and so allocated and reserved bytes, peaks, breakdown and trace too (a limit
    /// lifted at an out-of-memory error that changed nothing included).
    pub(crate) fn unlimited(&self) -> bool {
        !self.allocator.limit_has_acted()
    }

    /// Memory taken outside the caching allocator (a rollout engine's pool) on a device of
    /// `device_total` allocator bytes, after the allocator was limited to what is left: when
    /// what the allocator holds does not leave room for it, that is where the run runs out.
    /// The rest of the run goes on without a limit.
    pub(crate) fn outside_allocation(
        &mut self,
        bytes: u64,
        device_total: u64,
        label: &'static str,
    ) {
        let stats = self.allocator.stats();
        let reserved = stats.reserved_bytes.all.current as u64;
        if reserved + bytes <= device_total || self.oom.is_some() {
            return;
        }
        self.oom = Some(SimulatedOom {
            step: self.step,
            phase: self.phase,
            tensor: label,
            requested_bytes: bytes,
            error: OutOfMemory::Device(headroom_alloc::DeviceOutOfMemory {
                requested: bytes,
                alloc_size: bytes,
                device: 0,
                device_total,
                device_free: device_total.saturating_sub(reserved),
                allocated_bytes: stats.allocated_bytes.all.current as u64,
                reserved_bytes: reserved,
            }),
        });
        self.allocator.set_capacity(None);
    }

    /// Whether the run stopped at an out-of-memory error.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped.is_some()
    }

    pub(crate) fn oom(&self) -> Option<&SimulatedOom> {
        self.oom.as_ref()
    }

    pub(crate) fn take_trace(&mut self) -> Vec<TraceEvent> {
        self.trace.take().unwrap_or_default()
    }
}
