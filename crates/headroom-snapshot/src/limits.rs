//! The bounds that make reading any file end in bounded time and memory.
//!
//! A genuine snapshot costs about five times its pickle's size in memory to read. A hostile
//! file is held to the same order: its pickle is at most [`MAX_PICKLE_BYTES`] and at most
//! [`MAX_GZIP_RATIO`] times the gzip read to produce it; each opcode byte adds at most one value to the stack
//! (itself at most [`MAX_STACK`] deep), one object to the heap or one memo slot; and the
//! conversion to a [`Snapshot`](crate::Snapshot) visits no more values than the pickle made,
//! so objects the memo shares cannot be multiplied into gigabytes of segments, blocks or trace
//! entries.

/// The largest pickle read, compressed or not, and the file size read. A rank's snapshot of
/// a long 8-GPU run is a few hundred MB of pickle (the largest in bench/ is 70 MB for 530,000
/// trace entries); 4 GiB is ten times that, about 20 GiB of memory to read, and keeps every
/// heap index within `u32`.
pub const MAX_PICKLE_BYTES: u64 = 4 << 30;

/// How many times the gzip data read so far its decompressed output may be. Snapshots
/// compress 13:1 to 18:1 (every file in bench/), no prefix past the first MiB more than 24:1,
/// and a deflate bomb about 1000:1; 128 leaves real snapshots a wide margin, and one that
/// exceeds it can be gunzipped and read uncompressed.
pub const MAX_GZIP_RATIO: u64 = 128;

/// Gzip data may always decompress this far, whatever its ratio: the start of a stream
/// compresses worse or better than the whole, and this much costs little.
pub const MIN_GZIP_ALLOWANCE: u64 = 1 << 20;

/// The deepest the pickle machine's value stack (and its MARK stack) may get. `pickle.dump`
/// writes containers in batches of 1000 items and snapshots nest a few levels deep, so a real
/// snapshot never holds more than a few thousand values there; a stream of `DUP`s could
/// otherwise push one 16-byte value per byte.
pub const MAX_STACK: usize = 1 << 24;

/// The most bytes the first `compressed` bytes of gzip data may decompress to.
pub(crate) fn decompressed_limit(compressed: u64) -> u64 {
    compressed
        .saturating_mul(MAX_GZIP_RATIO)
        .clamp(MIN_GZIP_ALLOWANCE, MAX_PICKLE_BYTES)
}
