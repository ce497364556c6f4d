//! Argument checks shared by the backends: they run before anything is
//! submitted, so bad input is a typed error and never poisons a healthy
//! communicator.

use crate::backend::Result;
use crate::error::CommError;

/// Checks a buffer argument: whole elements, non-null, aligned.
pub fn check_buffer(
    op: &'static str,
    what: &str,
    ptr: u64,
    bytes: usize,
    elem: usize,
) -> Result<()> {
    if !bytes.is_multiple_of(elem) {
        return Err(CommError::InvalidArgument {
            op,
            reason: format!("{what}: {bytes} bytes is not a whole number of {elem}-byte elements"),
        });
    }
    if bytes > 0 && ptr == 0 {
        return Err(CommError::InvalidArgument {
            op,
            reason: format!("{what}: null device address"),
        });
    }
    if !ptr.is_multiple_of(elem as u64) {
        return Err(CommError::InvalidArgument {
            op,
            reason: format!("{what}: address {ptr:#x} is not aligned to {elem} bytes"),
        });
    }
    Ok(())
}

/// `bytes * world_size`, the size of a buffer that holds every rank's part,
/// or an error when it overflows.
pub fn per_world(op: &'static str, bytes: usize, world_size: usize) -> Result<usize> {
    bytes
        .checked_mul(world_size)
        .ok_or(CommError::InvalidArgument {
            op,
            reason: "bytes * world_size overflows".into(),
        })
}

pub fn check_rank(op: &'static str, what: &str, r: usize, world_size: usize) -> Result<()> {
    if r >= world_size {
        return Err(CommError::InvalidArgument {
            op,
            reason: format!("{what} {r} is out of range for {world_size} ranks"),
        });
    }
    Ok(())
}

/// Checks a buffer to register: a valid, non-empty byte range.
pub fn check_register(op: &'static str, ptr: u64, bytes: usize) -> Result<()> {
    check_buffer(op, "buffer", ptr, bytes, 1)?;
    if bytes == 0 {
        return Err(CommError::InvalidArgument {
            op,
            reason: "cannot register an empty buffer".into(),
        });
    }
    Ok(())
}

/// Checks an allocation size.
pub fn check_alloc(op: &'static str, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Err(CommError::InvalidArgument {
            op,
            reason: "cannot allocate 0 bytes".into(),
        });
    }
    Ok(())
}

/// Checks a `CUfunction` handle.
pub fn check_function(op: &'static str, function: u64) -> Result<()> {
    if function == 0 {
        return Err(CommError::InvalidArgument {
            op,
            reason: "null CUfunction".into(),
        });
    }
    Ok(())
}
