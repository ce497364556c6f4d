//! A compile-time check that every exported C function has exactly the
//! signature the bindings expect: each one is coerced to the type of the
//! matching field of `CudaLib` / `NcclLib` (and the hand-declared
//! `cuda_sys::ipc::IpcLib`). Never run; it only has to compile.
//!
//! Invariant: the lists cover every field of both tables.

#![allow(dead_code)]

use crate::cuda::driver::*;
use crate::cuda::event::*;
use crate::cuda::graph::*;
use crate::cuda::ipc::*;
use crate::cuda::memory::allocate::*;
use crate::cuda::memory::copy::*;
use crate::cuda::stream::*;
use crate::kernels::module::*;
use crate::nccl::errors::*;
use crate::nccl::group::*;
use crate::nccl::init::*;
use crate::nccl::lifecycle::*;
use crate::nccl::ops::*;
use crate::nccl::reg::*;
use crate::nccl::split::*;

fn same<T, E>(_: &Result<T, E>, _: T) {}

fn cuda(lib: &cuda_sys::CudaLib) {
    same(&lib.cuCtxEnablePeerAccess, cuCtxEnablePeerAccess);
    same(&lib.cuCtxGetCurrent, cuCtxGetCurrent);
    same(&lib.cuCtxGetDevice, cuCtxGetDevice);
    same(&lib.cuCtxSetCurrent, cuCtxSetCurrent);
    same(&lib.cuCtxSynchronize, cuCtxSynchronize);
    same(&lib.cuDeviceCanAccessPeer, cuDeviceCanAccessPeer);
    same(&lib.cuDeviceGet, cuDeviceGet);
    same(&lib.cuDeviceGetAttribute, cuDeviceGetAttribute);
    same(&lib.cuDeviceGetCount, cuDeviceGetCount);
    same(&lib.cuDeviceGetName, cuDeviceGetName);
    same(&lib.cuDeviceGetPCIBusId, cuDeviceGetPCIBusId);
    same(
        &lib.cuDevicePrimaryCtxRelease_v2,
        cuDevicePrimaryCtxRelease_v2,
    );
    same(&lib.cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain);
    same(&lib.cuDeviceTotalMem_v2, cuDeviceTotalMem_v2);
    same(&lib.cuDriverGetVersion, cuDriverGetVersion);
    same(&lib.cuEventCreate, cuEventCreate);
    same(&lib.cuEventDestroy_v2, cuEventDestroy_v2);
    same(&lib.cuEventElapsedTime_v2, cuEventElapsedTime_v2);
    same(&lib.cuEventQuery, cuEventQuery);
    same(&lib.cuEventRecord, cuEventRecord);
    same(&lib.cuEventSynchronize, cuEventSynchronize);
    same(&lib.cuGetErrorName, cuGetErrorName);
    same(&lib.cuGetErrorString, cuGetErrorString);
    same(&lib.cuGraphDestroy, cuGraphDestroy);
    same(&lib.cuGraphExecDestroy, cuGraphExecDestroy);
    same(
        &lib.cuGraphInstantiateWithFlags,
        cuGraphInstantiateWithFlags,
    );
    same(&lib.cuGraphLaunch, cuGraphLaunch);
    same(&lib.cuInit, cuInit);
    same(&lib.cuLaunchKernel, cuLaunchKernel);
    same(&lib.cuLaunchKernelEx, cuLaunchKernelEx);
    same(&lib.cuMemAllocHost_v2, cuMemAllocHost_v2);
    same(&lib.cuMemAlloc_v2, cuMemAlloc_v2);
    same(&lib.cuMemFreeHost, cuMemFreeHost);
    same(&lib.cuMemFree_v2, cuMemFree_v2);
    same(&lib.cuMemGetInfo_v2, cuMemGetInfo_v2);
    same(&lib.cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2);
    same(&lib.cuMemcpyDtoD_v2, cuMemcpyDtoD_v2);
    same(&lib.cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2);
    same(&lib.cuMemcpyDtoH_v2, cuMemcpyDtoH_v2);
    same(&lib.cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2);
    same(&lib.cuMemcpyHtoD_v2, cuMemcpyHtoD_v2);
    same(&lib.cuMemsetD32Async, cuMemsetD32Async);
    same(&lib.cuMemsetD32_v2, cuMemsetD32_v2);
    same(&lib.cuMemsetD8Async, cuMemsetD8Async);
    same(&lib.cuMemsetD8_v2, cuMemsetD8_v2);
    same(&lib.cuModuleGetFunction, cuModuleGetFunction);
    same(&lib.cuModuleLoadData, cuModuleLoadData);
    same(&lib.cuModuleUnload, cuModuleUnload);
    same(&lib.cuPointerGetAttribute, cuPointerGetAttribute);
    same(&lib.cuStreamBeginCapture_v2, cuStreamBeginCapture_v2);
    same(&lib.cuStreamCreate, cuStreamCreate);
    same(&lib.cuStreamDestroy_v2, cuStreamDestroy_v2);
    same(&lib.cuStreamEndCapture, cuStreamEndCapture);
    same(&lib.cuStreamIsCapturing, cuStreamIsCapturing);
    same(&lib.cuStreamQuery, cuStreamQuery);
    same(&lib.cuStreamSynchronize, cuStreamSynchronize);
    same(&lib.cuStreamWaitEvent, cuStreamWaitEvent);
}

fn nccl(lib: &nccl_sys::NcclLib) {
    same(&lib.ncclAllGather, ncclAllGather);
    same(&lib.ncclAllReduce, ncclAllReduce);
    same(&lib.ncclAlltoAll, ncclAlltoAll);
    same(&lib.ncclBcast, ncclBcast);
    same(&lib.ncclBroadcast, ncclBroadcast);
    same(&lib.ncclCommAbort, ncclCommAbort);
    same(&lib.ncclCommCount, ncclCommCount);
    same(&lib.ncclCommCuDevice, ncclCommCuDevice);
    same(&lib.ncclCommDeregister, ncclCommDeregister);
    same(&lib.ncclCommDestroy, ncclCommDestroy);
    same(&lib.ncclCommFinalize, ncclCommFinalize);
    same(&lib.ncclCommGetAsyncError, ncclCommGetAsyncError);
    same(&lib.ncclCommInitAll, ncclCommInitAll);
    same(&lib.ncclCommInitRank, ncclCommInitRank);
    same(&lib.ncclCommInitRankConfig, ncclCommInitRankConfig);
    same(&lib.ncclCommInitRankScalable, ncclCommInitRankScalable);
    same(&lib.ncclCommRegister, ncclCommRegister);
    same(&lib.ncclCommShrink, ncclCommShrink);
    same(&lib.ncclCommSplit, ncclCommSplit);
    same(&lib.ncclCommUserRank, ncclCommUserRank);
    same(&lib.ncclCommWindowDeregister, ncclCommWindowDeregister);
    same(&lib.ncclCommWindowRegister, ncclCommWindowRegister);
    same(&lib.ncclGather, ncclGather);
    same(&lib.ncclGetErrorString, ncclGetErrorString);
    same(&lib.ncclGetLastError, ncclGetLastError);
    same(&lib.ncclGetUniqueId, ncclGetUniqueId);
    same(&lib.ncclGetVersion, ncclGetVersion);
    same(&lib.ncclGroupEnd, ncclGroupEnd);
    same(&lib.ncclGroupSimulateEnd, ncclGroupSimulateEnd);
    same(&lib.ncclGroupStart, ncclGroupStart);
    same(&lib.ncclMemAlloc, ncclMemAlloc);
    same(&lib.ncclMemFree, ncclMemFree);
    same(&lib.ncclRecv, ncclRecv);
    same(&lib.ncclRedOpCreatePreMulSum, ncclRedOpCreatePreMulSum);
    same(&lib.ncclRedOpDestroy, ncclRedOpDestroy);
    same(&lib.ncclReduce, ncclReduce);
    same(&lib.ncclReduceScatter, ncclReduceScatter);
    same(&lib.ncclScatter, ncclScatter);
    same(&lib.ncclSend, ncclSend);
}

fn ipc(lib: &cuda_sys::ipc::IpcLib) {
    same(&lib.cuIpcCloseMemHandle, cuIpcCloseMemHandle);
    same(&lib.cuIpcGetMemHandle, cuIpcGetMemHandle);
    same(&lib.cuIpcOpenMemHandle_v2, cuIpcOpenMemHandle_v2);
}
