//! Bad inputs: every call the backend must refuse, each with its typed
//! error, before anything is submitted; then a correct all-reduce, and
//! every call after shutdown refused with `Shutdown`.
//!
//! Invariants: no refused call reaches NCCL or poisons the backend; the
//! views of bad addresses are never dereferenced.

use anyhow::{Context as _, ensure};
use half::bf16;
use metrale_comm::AddKernel;
use metrale_comm::{CommBackend, CommError};
use nccl_safe::{DataType, DeviceBuffer, DeviceView, DeviceViewMut, Stream};

use crate::RankCtx;
use crate::data::{check, random_vec, sum_in_rank_order};
use crate::scenarios::exact;

/// At least 15 bad inputs, each with its typed error; the backend stays
/// healthy and a correct all_reduce follows.
pub fn bad_inputs(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("bad")?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let b = ctx.backend("bad", ctx.config())?;
    let c = b.context().clone();
    let stream = Stream::new(&c)?;
    let buf = DeviceBuffer::<bf16>::alloc(&c, 64)?;
    let p = buf.device_ptr();
    let s = stream.as_ref();
    type Kind = fn(&CommError) -> bool;
    let invalid: Kind = |e| matches!(e, CommError::InvalidArgument { .. });
    let unknown: Kind = |e| matches!(e, CommError::UnknownHandle { .. });
    let in_group: Kind = |e| matches!(e, CommError::InGroup { .. });
    let input: Kind = |e| e.is_invalid_input();
    let bf = DataType::Bfloat16;
    // Views of `buf` (128 bytes of this device) and of bad addresses; every
    // call below is refused before anything is submitted.
    // SAFETY: `p..p+128` is `buf`, alive to the end of this function; the
    // null and misaligned views are refused by the argument checks.
    let m = |ptr: u64, len: usize, dt: DataType| unsafe { DeviceViewMut::from_raw(ptr, len, dt) };
    // SAFETY: as above.
    let v = |ptr: u64, len: usize, dt: DataType| unsafe { DeviceView::from_raw(ptr, len, dt) };
    let mut table: Vec<(&str, Kind, metrale_comm::Result<()>)> = vec![
        (
            "all_reduce null address",
            invalid,
            b.all_reduce(m(0, 32, bf)),
        ),
        (
            "all_reduce misaligned address",
            invalid,
            b.all_reduce(m(p + 1, 32, bf)),
        ),
        (
            "all_reduce of fp8",
            invalid,
            b.all_reduce(m(p, 64, DataType::Float8E4M3)),
        ),
        (
            "all_reduce_async misaligned f32",
            invalid,
            b.all_reduce_async(m(p + 2, 8, DataType::Float32), s),
        ),
        (
            "all_gather null send address",
            invalid,
            b.all_gather(v(0, 16, bf), m(p, 16 * w, bf)),
        ),
        (
            "all_gather null receive address",
            invalid,
            b.all_gather(v(p, 16, bf), m(0, 16 * w, bf)),
        ),
        (
            "all_gather types differ",
            invalid,
            b.all_gather(v(p, 8, bf), m(p, 8 * w, DataType::Float16)),
        ),
        (
            "all_gather receive too short",
            invalid,
            b.all_gather(v(p, 8, bf), m(p, 8 * w - 1, bf)),
        ),
        (
            "reduce_scatter send too short",
            invalid,
            b.reduce_scatter(
                v(p, 8 * w + 1, DataType::Float32),
                m(p, 8, DataType::Float32),
            ),
        ),
        (
            "reduce_scatter null",
            invalid,
            b.reduce_scatter(v(0, 4 * w, bf), m(p, 4, bf)),
        ),
        (
            "broadcast root out of range",
            invalid,
            b.broadcast(m(p, 32, bf), w),
        ),
        ("broadcast null", invalid, b.broadcast(m(0, 32, bf), 0)),
        ("send_to self", invalid, b.send_to(v(p, 32, bf), r, s)),
        (
            "send_to rank out of range",
            invalid,
            b.send_to(v(p, 32, bf), w + 2, s),
        ),
        ("recv_from self", invalid, b.recv_from(m(p, 32, bf), r, s)),
        (
            "recv_from rank out of range",
            invalid,
            b.recv_from(m(p, 32, bf), w, s),
        ),
        (
            "recv_command_u32 root out of range",
            invalid,
            b.recv_command_u32(m(p, 1, DataType::Uint32), w),
        ),
        (
            "recv_command_u32 of 8 bytes",
            invalid,
            b.recv_command_u32(m(p, 2, DataType::Uint32), (r + 1) % w),
        ),
        (
            "all_to_all_v with too few counts",
            invalid,
            b.all_to_all_v(v(p, 8, bf), &[8], m(p, 8, bf), &vec![0; w + 1]),
        ),
        (
            "all_to_all_v counts past the buffer",
            invalid,
            b.all_to_all_v(v(p, 8, bf), &vec![9; w], m(p, 64, bf), &vec![9; w]),
        ),
        (
            "set_add_kernel null",
            invalid,
            // SAFETY: refused (null) before it is ever launched.
            b.set_add_kernel(unsafe { AddKernel::from_raw(std::ptr::null_mut()) }),
        ),
    ];
    if w > 1 {
        table.push((
            "all_to_all of unequal blocks",
            invalid,
            b.all_to_all(v(p, 8 * w + 1, bf), m(p, 8 * w + 1, bf)),
        ));
    }
    // SAFETY: refused (null) before NCCL sees it.
    let null_registration = unsafe { b.register_buffer(v(0, 32, bf)) }.map(|_| ());
    table.push(("register_buffer null", invalid, null_registration));
    // SAFETY: a handle value this backend never handed out.
    let never = unsafe { metrale_comm::Registration::from_raw(0xdead_beef) };
    table.push((
        "deregister_buffer unknown",
        unknown,
        b.deregister_buffer(never),
    ));
    // SAFETY: an address this backend never handed out.
    let stranger = unsafe { metrale_comm::SymmetricAlloc::from_raw(0x1234_5000, 256) };
    table.push((
        "symmetric_free unknown",
        unknown,
        b.symmetric_free(stranger),
    ));
    let sym = b.symmetric_alloc(256)?;
    let (sp, sn) = (sym.ptr(), sym.bytes());
    b.symmetric_free(sym)?;
    // SAFETY: a copy of a freed handle, which the backend must refuse.
    let again = unsafe { metrale_comm::SymmetricAlloc::from_raw(sp, sn) };
    table.push(("symmetric_free twice", unknown, b.symmetric_free(again)));
    // SAFETY: buf is 128 bytes of this device, alive past the deregistration.
    let h = unsafe { b.register_buffer(buf.view())? };
    let raw = h.as_raw();
    b.deregister_buffer(h)?;
    // SAFETY: a copy of a released handle, which the backend must refuse.
    let again = unsafe { metrale_comm::Registration::from_raw(raw) };
    table.push((
        "deregister_buffer twice",
        unknown,
        b.deregister_buffer(again),
    ));
    b.group_start()?;
    table.push(("synchronize inside a group", in_group, b.synchronize()));
    table.push(("barrier inside a group", in_group, b.barrier()));
    table.push((
        "broadcast inside a group",
        in_group,
        b.broadcast(m(p, 32, bf), 0),
    ));
    b.group_end()?;
    table.push(("group_end without group_start", input, b.group_end()));
    let mut failures = Vec::new();
    for (what, kind, res) in &table {
        match res {
            Err(e) if kind(e) => tracing::debug!("{what}: {e}"),
            Err(e) => failures.push(format!("{what}: wrong error: {e:?}")),
            Ok(()) => failures.push(format!("{what}: accepted")),
        }
    }
    ensure!(table.len() >= 15, "only {} bad inputs", table.len());
    ensure!(
        failures.is_empty(),
        "bad inputs:\n  {}",
        failures.join("\n  ")
    );
    ensure!(
        b.is_healthy(),
        "backend unhealthy after bad inputs: {:?}",
        b.failure()
    );
    ctx.step("all_reduce after bad inputs");
    let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, 9, 1000)).collect();
    let mut buf = DeviceBuffer::from_host(&c, &inputs[r])?;
    b.all_reduce(buf.view_mut())?;
    b.synchronize()?;
    check(
        "all_reduce after bad inputs",
        &buf.to_host_vec()?,
        &sum_in_rank_order(&inputs),
        exact(ctx),
        w,
    )?;
    ctx.barrier("bad inputs reduced")?;
    b.shutdown()?;
    ctx.step("calls after shutdown");
    ensure!(!b.is_healthy(), "healthy after shutdown");
    let reduced = b.all_reduce(buf.view_mut());
    let after = [
        ("all_reduce", reduced),
        ("barrier", b.barrier()),
        ("synchronize", b.synchronize()),
        ("attempt_reconnect", b.attempt_reconnect()),
        ("symmetric_alloc", b.symmetric_alloc(64).map(|_| ())),
    ];
    for (what, res) in after {
        ensure!(
            matches!(res, Err(CommError::Shutdown { .. })),
            "{what} after shutdown: expected Shutdown, got {res:?}"
        );
    }
    b.shutdown().context("a second shutdown")?;
    Ok(())
}
