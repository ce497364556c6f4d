//! The one-shot all-reduce's ABI: its control block, lanes, claim words,
//! statuses, receive-buffer layout and launch contract
//! (`crates/metrale-comm/kernels/one_shot.cu` has the protocol).
//!
//! Launch contract: `{bf16,f16,f32}_one_shot_all_reduce(OsCtrl* ctrl, T*
//! data, u64 n, u32 lane)`, in place, `1 <= n`, `n * size_of::<T>() <=
//! ctrl.slot_bytes`, `lane` [`LANE_EAGER`] or [`LANE_GRAPH`], [`MIN_THREADS`]
//! to [`BLOCK`] threads a block in x, any grid (grid-stride loops, 32-bit
//! counts), static shared memory only; one thread moves [`UNIT_BYTES`].
//!
//! Invariants: [`Ctrl`] is the C struct `OsCtrl` byte for byte (the
//! offsets below are checked at compile time here and by `static_assert` in
//! the generated header); a free receive-buffer word holds [`SENTINEL`];
//! a status is recorded once (the first wins).

use std::fmt::Write as _;
use std::mem::{offset_of, size_of};

/// The most ranks a control block serves.
pub const MAX_RANKS: usize = 8;
/// Lanes of a control block and a receive buffer.
pub const LANES: usize = 2;
/// The lane of eager calls.
pub const LANE_EAGER: u32 = 0;
/// The lane of calls captured into CUDA graphs.
pub const LANE_GRAPH: u32 = 1;
/// Halves of a lane: a call uses half `epoch & 1`.
pub const HALVES: usize = 2;
/// What every 32-bit word of a receive buffer holds outside a call (the
/// bf16 or f16 pair (+0.0, -0.0), the f32 -0.0): "not arrived". A pushed
/// word equal to it is sent as 0.
pub const SENTINEL: u32 = 0x8000_0000;
/// The largest slot a control block may name: 2 lanes x 2 halves x 8
/// slots of it span at most 2^31 bytes, so offsets in a receive buffer fit
/// 32 bits.
pub const MAX_SLOT_BYTES: usize = 1 << 26;
/// A slot is a whole number of these.
pub const UNIT_BYTES: usize = 16;
/// The most threads a block (the kernels' `__launch_bounds__`).
pub const BLOCK: u32 = 512;
/// The fewest threads a block.
pub const MIN_THREADS: u32 = 8;
/// Blocks of [`BLOCK`] threads an SM must hold at once (the second bound:
/// at most 64 registers a thread).
pub const MIN_BLOCKS: u32 = 2;
/// A spinning thread reads the abort word, `failed` and the clock every
/// this many tries.
pub const POLL_EVERY: u32 = 256;
/// How long a thread waits before it reads the host-pinned abort word at
/// all (no host read on the path of a call that does not wait).
pub const HOST_POLL_AFTER_NS: u64 = 100_000;
/// Bits of a lane's claim word that hold the epoch (mod 256); the owner
/// tag sits above them.
pub const EPOCH_BITS: u32 = 8;
/// Bits of a launch number in an owner tag (each tag is that number and
/// its complement: exactly this many bits set).
pub const TAG_HALF_BITS: u32 = 28;
/// Index of the abort word among the host-pinned flag words.
pub const FLAG_ABORT: usize = 0;
/// Index of the status word among the host-pinned flag words.
pub const FLAG_STATUS: usize = 1;
/// Host-pinned `u32` flag words a control block points at.
pub const FLAG_WORDS: usize = 2;

/// One lane's state, in the rank's device memory (C `OsLane`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lane {
    /// Owner tag << [`EPOCH_BITS`] | epoch mod 256; tag 0 when free.
    pub claim: u64,
    /// Blocks of the running call that finished.
    pub arrived: u32,
    /// Padding.
    pub pad: u32,
}

/// A rank's control block, in its device memory (C `OsCtrl`); the host
/// writes it at set-up.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ctrl {
    /// Each rank's receive buffer, as mapped on this rank.
    pub peer: [u64; MAX_RANKS],
    /// Device address of the [`FLAG_WORDS`] host-pinned `u32` words.
    pub flags: u64,
    /// How long a thread may spin, in nanoseconds.
    pub timeout_ns: u64,
    /// This rank.
    pub rank: u32,
    /// The number of ranks.
    pub world: u32,
    /// Bytes of one slot, a multiple of [`UNIT_BYTES`].
    pub slot_bytes: u64,
    /// The lanes.
    pub lane: [Lane; LANES],
    /// The status recorded, 0: none.
    pub failed: u32,
    /// Padding.
    pub pad: u32,
}

/// Byte offsets of [`Ctrl`]'s fields (C `OsCtrl`).
pub const OFF_PEER: usize = offset_of!(Ctrl, peer);
/// See [`OFF_PEER`].
pub const OFF_FLAGS: usize = offset_of!(Ctrl, flags);
/// See [`OFF_PEER`].
pub const OFF_TIMEOUT_NS: usize = offset_of!(Ctrl, timeout_ns);
/// See [`OFF_PEER`].
pub const OFF_RANK: usize = offset_of!(Ctrl, rank);
/// See [`OFF_PEER`].
pub const OFF_WORLD: usize = offset_of!(Ctrl, world);
/// See [`OFF_PEER`].
pub const OFF_SLOT_BYTES: usize = offset_of!(Ctrl, slot_bytes);
/// See [`OFF_PEER`].
pub const OFF_LANE: usize = offset_of!(Ctrl, lane);
/// See [`OFF_PEER`].
pub const OFF_FAILED: usize = offset_of!(Ctrl, failed);
/// Bytes of a [`Ctrl`].
pub const CTRL_BYTES: usize = size_of::<Ctrl>();
/// Bytes of a [`Lane`].
pub const LANE_BYTES: usize = size_of::<Lane>();
/// 64-bit words of a [`Ctrl`].
pub const CTRL_WORDS: usize = CTRL_BYTES / 8;

// The layout the kernels were written against: a change here is a change
// of the ABI, made on purpose.
const _: () = {
    assert!(OFF_PEER == 0);
    assert!(OFF_FLAGS == 64);
    assert!(OFF_TIMEOUT_NS == 72);
    assert!(OFF_RANK == 80);
    assert!(OFF_WORLD == 84);
    assert!(OFF_SLOT_BYTES == 88);
    assert!(OFF_LANE == 96);
    assert!(LANE_BYTES == 16);
    assert!(OFF_FAILED == 128);
    assert!(CTRL_BYTES == 136);
    assert!(offset_of!(Lane, arrived) == 8);
    assert!(MAX_SLOT_BYTES * LANES * HALVES * MAX_RANKS <= 1 << 31);
    assert!(2 * TAG_HALF_BITS + EPOCH_BITS <= 64);
};

/// What a kernel recorded: why a call gave up or was refused.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// A thread waited past `timeout_ns` for a peer's contribution.
    Timeout = 1,
    /// The abort word was set while a thread waited.
    Aborted = 2,
    /// The call found its lane held by another running call of this rank.
    Concurrent = 3,
    /// The launch broke the launch contract (lane, world, rank, count,
    /// slot): refused, nothing touched.
    BadLaunch = 4,
}

impl Status {
    /// Every status, in code order.
    pub const ALL: [Status; 4] = [
        Status::Timeout,
        Status::Aborted,
        Status::Concurrent,
        Status::BadLaunch,
    ];

    /// The status with code `code`; `None` for 0 (no status) or an unknown
    /// code.
    pub fn from_code(code: u32) -> Option<Status> {
        Status::ALL.into_iter().find(|s| s.code() == code)
    }

    /// Its code in `failed` and the status word.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The C macro naming it.
    pub fn c_name(self) -> &'static str {
        match self {
            Status::Timeout => "OS_STATUS_TIMEOUT",
            Status::Aborted => "OS_STATUS_ABORTED",
            Status::Concurrent => "OS_STATUS_CONCURRENT",
            Status::BadLaunch => "OS_STATUS_BAD_LAUNCH",
        }
    }

    /// What it means, in words.
    pub fn describe(self) -> &'static str {
        match self {
            Status::Timeout => "a kernel waited past its timeout for a peer's contribution",
            Status::Aborted => "a kernel saw the abort word while it waited",
            Status::Concurrent => "two one-shot all-reduces ran at once on one lane of this rank",
            Status::BadLaunch => "a kernel refused a launch outside its contract",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (status {})", self.describe(), self.code())
    }
}

/// The entry points, by the element type each all-reduces (its C type).
pub const ENTRIES: [(&str, &str); 3] = [
    ("bf16_one_shot_all_reduce", "__nv_bfloat16"),
    ("f16_one_shot_all_reduce", "__half"),
    ("f32_one_shot_all_reduce", "float"),
];

/// The owner tag of launch number `n` (the GPU's `%gridid`): `n` mod
/// 2^[`TAG_HALF_BITS`] and its complement above it, so every tag has
/// exactly [`TAG_HALF_BITS`] bits set, no tag is 0 and the OR of two
/// different tags is no tag.
pub const fn owner_tag(n: u64) -> u64 {
    let mask = (1u64 << TAG_HALF_BITS) - 1;
    let v = n & mask;
    v | ((!v & mask) << TAG_HALF_BITS)
}

/// Bytes of one rank's receive buffer: [`LANES`] x [`HALVES`] x `world`
/// slots of `slot_bytes`.
pub const fn recv_bytes(world: usize, slot_bytes: usize) -> usize {
    LANES * HALVES * world * slot_bytes
}

/// The byte offset in a receive buffer of slot `peer` (the slot rank
/// `peer` pushes into) of half `half` of lane `lane`.
pub const fn slot_offset(
    lane: u32,
    half: u32,
    world: usize,
    peer: usize,
    slot_bytes: usize,
) -> usize {
    ((lane as usize * HALVES + half as usize) * world + peer) * slot_bytes
}

impl Ctrl {
    /// The control block of rank `rank` of `peers.len()` (2 to
    /// [`MAX_RANKS`]), lanes free at epoch 0, no status: `peers[p]` is rank
    /// `p`'s receive buffer as mapped on this rank, `flags` the device
    /// address of the flag words. `None` for a world outside 2 to 8, a rank
    /// outside it, or a slot that is not a whole number of [`UNIT_BYTES`]
    /// or is larger than [`MAX_SLOT_BYTES`].
    pub fn new(
        peers: &[u64],
        flags: u64,
        timeout_ns: u64,
        rank: usize,
        slot_bytes: usize,
    ) -> Option<Ctrl> {
        if !(2..=MAX_RANKS).contains(&peers.len())
            || rank >= peers.len()
            || !slot_bytes.is_multiple_of(UNIT_BYTES)
            || slot_bytes > MAX_SLOT_BYTES
        {
            return None;
        }
        let mut peer = [0u64; MAX_RANKS];
        peer[..peers.len()].copy_from_slice(peers);
        Some(Ctrl {
            peer,
            flags,
            timeout_ns,
            rank: rank as u32,
            world: peers.len() as u32,
            slot_bytes: slot_bytes as u64,
            lane: [Lane::default(); LANES],
            failed: 0,
            pad: 0,
        })
    }

    /// The block as the device holds it: [`CTRL_WORDS`] native-endian
    /// 64-bit words.
    pub fn to_words(&self) -> [u64; CTRL_WORDS] {
        let mut bytes = [0u8; CTRL_BYTES];
        let mut put = |off: usize, b: &[u8]| bytes[off..off + b.len()].copy_from_slice(b);
        for (p, v) in self.peer.iter().enumerate() {
            put(OFF_PEER + 8 * p, &v.to_ne_bytes());
        }
        put(OFF_FLAGS, &self.flags.to_ne_bytes());
        put(OFF_TIMEOUT_NS, &self.timeout_ns.to_ne_bytes());
        put(OFF_RANK, &self.rank.to_ne_bytes());
        put(OFF_WORLD, &self.world.to_ne_bytes());
        put(OFF_SLOT_BYTES, &self.slot_bytes.to_ne_bytes());
        for (l, lane) in self.lane.iter().enumerate() {
            let at = OFF_LANE + LANE_BYTES * l;
            put(at, &lane.claim.to_ne_bytes());
            put(at + offset_of!(Lane, arrived), &lane.arrived.to_ne_bytes());
            put(at + offset_of!(Lane, pad), &lane.pad.to_ne_bytes());
        }
        put(OFF_FAILED, &self.failed.to_ne_bytes());
        put(offset_of!(Ctrl, pad), &self.pad.to_ne_bytes());
        let mut words = [0u64; CTRL_WORDS];
        for (w, chunk) in words.iter_mut().zip(bytes.chunks_exact(8)) {
            *w = u64::from_ne_bytes(chunk.try_into().expect("8 bytes"));
        }
        words
    }
}

/// The C declarations of the fields, in order: (type, name, comment).
const CTRL_FIELDS: [(&str, &str, &str); 9] = [
    (
        "unsigned long long",
        "peer[OS_MAX_RANKS]",
        "each rank's receive buffer, as mapped here",
    ),
    (
        "unsigned long long",
        "flags",
        "host-pinned u32 words: [OS_FLAG_ABORT] abort, [OS_FLAG_STATUS] status",
    ),
    (
        "unsigned long long",
        "timeout_ns",
        "how long a thread may spin",
    ),
    ("unsigned int", "rank", "this rank"),
    ("unsigned int", "world", "the number of ranks"),
    (
        "unsigned long long",
        "slot_bytes",
        "bytes of one slot, a multiple of OS_UNIT_BYTES",
    ),
    ("OsLane", "lane[OS_LANES]", "the lanes"),
    ("unsigned int", "failed", "the status recorded, 0: none"),
    ("unsigned int", "pad", ""),
];

pub(crate) fn write_header(h: &mut String) {
    use crate::define;
    h.push_str("// The one-shot all-reduce (one_shot.cu).\n");
    define(
        h,
        "Most threads a block (__launch_bounds__).",
        "OS_BLOCK",
        BLOCK,
    );
    define(h, "Fewest threads a block.", "OS_MIN_THREADS", MIN_THREADS);
    define(
        h,
        "Blocks of OS_BLOCK threads an SM must hold at once: at most 64 registers\n\
         a thread, so a call's blocks leave room for other kernels' beside them,\n\
         and 8 ranks' calls simulated on one GPU (tests, benches) all fit at once.",
        "OS_MIN_BLOCKS",
        MIN_BLOCKS,
    );
    define(
        h,
        "Most ranks a control block serves.",
        "OS_MAX_RANKS",
        MAX_RANKS,
    );
    define(
        h,
        "Lanes of a control block and receive buffer.",
        "OS_LANES",
        LANES,
    );
    define(
        h,
        "The lane of eager calls.",
        "OS_LANE_EAGER",
        format!("{LANE_EAGER}u"),
    );
    define(
        h,
        "The lane of calls captured into graphs.",
        "OS_LANE_GRAPH",
        format!("{LANE_GRAPH}u"),
    );
    define(h, "Halves of a lane.", "OS_HALVES", HALVES);
    define(
        h,
        "What a free receive-buffer word holds.",
        "OS_SENTINEL",
        format!("0x{SENTINEL:08X}u"),
    );
    define(
        h,
        "The largest slot a launch may name: 2 lanes x 2 halves x 8 slots of it\n\
         span at most 2^31 bytes, so offsets in a receive buffer fit 32 bits.",
        "OS_MAX_SLOT",
        format!("(1u << {})", MAX_SLOT_BYTES.trailing_zeros()),
    );
    define(
        h,
        "Bytes one thread moves; a slot is a whole number of them.",
        "OS_UNIT_BYTES",
        UNIT_BYTES,
    );
    define(
        h,
        "A spinning thread checks the clock and flags every this many tries.",
        "OS_POLL_EVERY",
        POLL_EVERY,
    );
    define(
        h,
        "How long a thread waits before it reads host memory (the abort word).",
        "OS_HOST_POLL_AFTER_NS",
        format!("{HOST_POLL_AFTER_NS}ull"),
    );
    define(
        h,
        "Bits of a claim word holding the epoch (mod 256).",
        "OS_EPOCH_BITS",
        EPOCH_BITS,
    );
    define(
        h,
        "Bits of a launch number in an owner tag (tag = v | ~v << OS_TAG_HALF_BITS).",
        "OS_TAG_HALF_BITS",
        TAG_HALF_BITS,
    );
    define(
        h,
        "Index of the abort word among the flag words.",
        "OS_FLAG_ABORT",
        FLAG_ABORT,
    );
    define(
        h,
        "Index of the status word among the flag words.",
        "OS_FLAG_STATUS",
        FLAG_STATUS,
    );
    for s in Status::ALL {
        define(
            h,
            &format!("Status: {}.", s.describe()),
            s.c_name(),
            format!("{}u", s.code()),
        );
    }
    h.push_str(
        "\n// One lane's state, in this rank's device memory.\n\
         struct OsLane {\n    \
         unsigned long long claim;  // owner tag << OS_EPOCH_BITS | epoch; free: tag 0\n    \
         unsigned int arrived;      // blocks of the running call that finished\n    \
         unsigned int pad;\n\
         };\n\n\
         // This rank's control block, in its device memory; the host writes it\n\
         // at set-up.\n\
         struct OsCtrl {\n",
    );
    let offsets = [
        OFF_PEER,
        OFF_FLAGS,
        OFF_TIMEOUT_NS,
        OFF_RANK,
        OFF_WORLD,
        OFF_SLOT_BYTES,
        OFF_LANE,
        OFF_FAILED,
        offset_of!(Ctrl, pad),
    ];
    for ((ty, name, comment), off) in CTRL_FIELDS.iter().zip(offsets) {
        let decl = format!("{ty} {name};");
        let _ = if comment.is_empty() {
            writeln!(h, "    {decl:<40} // {off:>3}")
        } else {
            writeln!(h, "    {decl:<40} // {off:>3}: {comment}")
        };
    }
    h.push_str("};\n\n");
    let _ = writeln!(
        h,
        "static_assert(sizeof(OsLane) == {LANE_BYTES}, \"OsLane's size\");\n\
         static_assert(sizeof(OsCtrl) == {CTRL_BYTES}, \"OsCtrl's size\");"
    );
    for ((_, name, _), off) in CTRL_FIELDS.iter().zip(offsets) {
        let field = name.split('[').next().unwrap_or(name);
        let _ = writeln!(
            h,
            "static_assert(__builtin_offsetof(OsCtrl, {field}) == {off}, \"OsCtrl::{field}'s offset\");"
        );
    }
    h.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_and_zero_is_none() {
        assert_eq!(Status::from_code(0), None);
        assert_eq!(Status::from_code(99), None);
        for s in Status::ALL {
            assert_eq!(Status::from_code(s.code()), Some(s));
        }
    }

    #[test]
    fn no_tag_is_zero_nor_the_or_of_two_others() {
        for (a, b) in [(0u64, 1u64), (5, 6), (1 << 27, 3), ((1 << 28) - 1, 0)] {
            let (ta, tb) = (owner_tag(a), owner_tag(b));
            assert_eq!(ta.count_ones(), TAG_HALF_BITS);
            assert_ne!(ta, 0);
            assert_ne!(ta | tb, ta);
            assert_ne!((ta | tb).count_ones(), TAG_HALF_BITS);
        }
    }

    #[test]
    fn the_control_block_words_put_each_field_at_its_offset() {
        let c = Ctrl::new(&[0x10, 0x20, 0x30], 0xF1A9, 7, 2, 4096).expect("valid");
        let w = c.to_words();
        assert_eq!(&w[..3], &[0x10, 0x20, 0x30]);
        assert_eq!(w[OFF_FLAGS / 8], 0xF1A9);
        assert_eq!(w[OFF_TIMEOUT_NS / 8], 7);
        assert_eq!(w[OFF_RANK / 8], 2 | (3 << 32));
        assert_eq!(w[OFF_SLOT_BYTES / 8], 4096);
        assert!(w[OFF_LANE / 8..].iter().all(|&x| x == 0));
        assert_eq!(Ctrl::new(&[1], 0, 0, 0, 16), None, "one rank");
        assert_eq!(Ctrl::new(&[1, 2], 0, 0, 2, 16), None, "rank outside");
        assert_eq!(Ctrl::new(&[1, 2], 0, 0, 0, 24), None, "slot not in units");
        assert_eq!(Ctrl::new(&[1, 2], 0, 0, 0, MAX_SLOT_BYTES + 16), None);
    }

    #[test]
    fn slots_tile_the_receive_buffer() {
        let (world, slot) = (3, 64);
        let mut seen = Vec::new();
        for lane in 0..LANES as u32 {
            for half in 0..HALVES as u32 {
                for p in 0..world {
                    seen.push(slot_offset(lane, half, world, p, slot));
                }
            }
        }
        seen.sort_unstable();
        let want: Vec<usize> = (0..recv_bytes(world, slot) / slot)
            .map(|k| k * slot)
            .collect();
        assert_eq!(seen, want);
    }
}
