//! Bad inputs inside a fuzzed program: calls the backend must refuse with a
//! typed error, at any point of a schedule, without poisoning itself.
//!
//! Invariants: every bad call is refused by the argument checks before
//! anything is submitted, so the views made here with `from_raw` (an odd
//! address, fp8, a length or type that does not match) are never used by
//! the device; the rebuilt handles name a registration or allocation
//! released a moment before, by this thread, with no allocation between;
//! on a backend an earlier step poisoned, any error is accepted (the
//! backend refuses everything), but a healthy backend must stay healthy.

use half::bf16;
use metrale_comm::{CommBackend, CommError, Registration, SymmetricAlloc};
use nccl_safe::{DataType, DeviceBuffer, DeviceView, DeviceViewMut};

use super::exec::{Run, call};
use super::program::Bad;
use crate::data::POISON_BYTE;

type Kind = fn(&CommError) -> bool;

fn invalid(e: &CommError) -> bool {
    matches!(e, CommError::InvalidArgument { .. })
}

fn unknown(e: &CommError) -> bool {
    matches!(e, CommError::UnknownHandle { .. })
}

fn in_group(e: &CommError) -> bool {
    matches!(e, CommError::InGroup { .. })
}

/// Elements of the scratch buffer the bad calls point into.
const LEN: usize = 64;

impl Run<'_> {
    pub(super) fn bad(&self, b: usize, bad: Bad) -> anyhow::Result<()> {
        let be = &self.backends[b];
        let (rank, w) = (self.ctx.rank, self.prog.world);
        let healthy = be.is_healthy();
        let mut buf = DeviceBuffer::<bf16>::alloc(self.c, LEN)?;
        buf.fill_bytes(POISON_BYTE)?;
        let p = buf.device_ptr();
        let s = self.streams[0].as_ref();
        let bf = DataType::Bfloat16;
        // Views into `buf` (LEN bf16 elements of this device, alive past
        // every call), or views the argument checks refuse before use.
        let m = |ptr: u64, len: usize, dt: DataType| {
            // SAFETY: as above: `buf`'s memory, or refused unused.
            unsafe { DeviceViewMut::from_raw(ptr, len, dt) }
        };
        let v = |ptr: u64, len: usize, dt: DataType| {
            // SAFETY: as above.
            unsafe { DeviceView::from_raw(ptr, len, dt) }
        };
        let (r, kind, end): (Result<(), CommError>, Kind, Result<(), CommError>) = match bad {
            Bad::Misaligned => (be.all_reduce(m(p + 1, 8, bf)), invalid, Ok(())),
            Bad::Fp8Sum => (
                be.all_reduce(m(p, 16, DataType::Float8E4M3)),
                invalid,
                Ok(()),
            ),
            Bad::TypesDiffer => (
                be.all_gather(v(p, 1, bf), m(p, w, DataType::Float16)),
                invalid,
                Ok(()),
            ),
            Bad::LengthMismatch => (
                be.reduce_scatter(v(p, 2 * w + 1, bf), m(p, 2, bf)),
                invalid,
                Ok(()),
            ),
            Bad::CountsPastBuffer => (
                be.all_to_all_v(v(p, 4, bf), &vec![5; w], m(p, LEN, bf), &vec![5; w]),
                invalid,
                Ok(()),
            ),
            Bad::CommandSize => (
                be.recv_command_u32(m(p, 2, DataType::Uint32), (rank + 1) % w),
                invalid,
                Ok(()),
            ),
            Bad::SendToSelf => (be.send_to(v(p, 1, bf), rank, s), invalid, Ok(())),
            Bad::RootOutOfRange => (be.broadcast(m(p, 1, bf), w), invalid, Ok(())),
            Bad::UnknownHandle => {
                // SAFETY: a value this backend never handed out.
                let never = unsafe { Registration::from_raw(0xdead_beef) };
                (be.deregister_buffer(never), unknown, Ok(()))
            }
            Bad::ReleasedRegistration => match self.released_registration(b, &buf) {
                Ok(r) => (r, unknown, Ok(())),
                Err(e) if !healthy => (Err(e), unknown, Ok(())),
                Err(e) => return call("registering a buffer to release", Err(e)),
            },
            Bad::FreedSymmetric => match self.freed_symmetric(b) {
                Ok(r) => (r, unknown, Ok(())),
                Err(e) if !healthy => (Err(e), unknown, Ok(())),
                Err(e) => return call("allocating symmetric memory to free", Err(e)),
            },
            Bad::SyncInGroup => {
                call("group_start", be.group_start())?;
                let r = be.synchronize();
                (r, in_group, be.group_end())
            }
            Bad::GroupEndAlone => (be.group_end(), invalid, Ok(())),
        };
        drop(buf);
        call("group_end", end)?;
        match r {
            Err(e) if kind(&e) => {}
            Err(e) if !healthy => tracing::debug!("bad input on a poisoned backend: {e}"),
            Err(e) => anyhow::bail!("expected a typed refusal, got: {e}"),
            Ok(()) => anyhow::bail!("accepted"),
        }
        if healthy && !be.is_healthy() {
            anyhow::bail!(
                "the refused call poisoned the backend: {:?}",
                be.failure().map(|f| f.to_string())
            );
        }
        Ok(())
    }

    /// Registers `buf`, releases the registration, and releases it again
    /// through a handle rebuilt from its raw value: the second release's
    /// result (`Err` when the first two calls failed).
    fn released_registration(
        &self,
        b: usize,
        buf: &DeviceBuffer<bf16>,
    ) -> Result<Result<(), CommError>, CommError> {
        let be = &self.backends[b];
        // SAFETY: `buf` stays allocated past the deregistration below.
        let h = unsafe { be.register_buffer(buf.view()) }?;
        let raw = h.as_raw();
        be.deregister_buffer(h)?;
        // SAFETY: a copy of a released handle, which the backend must
        // refuse; it names nothing else (no registration since).
        let again = unsafe { Registration::from_raw(raw) };
        Ok(be.deregister_buffer(again))
    }

    /// Allocates symmetric memory, frees it, and frees it again through a
    /// handle rebuilt from its address: the second free's result.
    fn freed_symmetric(&self, b: usize) -> Result<Result<(), CommError>, CommError> {
        let be = &self.backends[b];
        let alloc = be.symmetric_alloc(256)?;
        let (ptr, bytes) = (alloc.ptr(), alloc.bytes());
        be.symmetric_free(alloc)?;
        // SAFETY: a copy of a freed handle, which the backend must refuse;
        // no allocation since could have reused its address.
        let again = unsafe { SymmetricAlloc::from_raw(ptr, bytes) };
        Ok(be.symmetric_free(again))
    }
}
