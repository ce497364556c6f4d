//! Which launcher started this process, and what it says: rank, world
//! size, device, where the store is and who serves it ([`Launch`]).
//!
//! One precedence, the first that applies (docs/operations.md,
//! "Launching"):
//! 1. torchrun: `TORCHELASTIC_RUN_ID` is set. `RANK`, `WORLD_SIZE`,
//!    `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; the
//!    agent serves the store when `TORCHELASTIC_USE_AGENT_STORE=True`; keys
//!    live under the run id and `TORCHELASTIC_RESTART_COUNT`.
//! 2. Explicit variables: `RANK` or `WORLD_SIZE` is set. With no
//!    `LOCAL_RANK` inside Kubernetes (`KUBERNETES_SERVICE_HOST`) it is a
//!    Kubeflow PyTorchJob: one GPU per pod, device 0; elsewhere
//!    `LOCAL_RANK` defaults to `RANK` (one machine).
//! 3. Open MPI: `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`.
//! 4. MPICH, Intel MPI (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`) or PMIx
//!    (`PMIX_RANK`, with the size and local rank from Slurm under srun).
//! 5. Slurm: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`.
//!
//! For 3-5 the store is at `MASTER_ADDR` (else the first host of
//! `SLURM_STEP_NODELIST`, else of `SLURM_JOB_NODELIST`) and `MASTER_PORT`
//! (else `29500 + SLURM_JOB_ID % 1000` in a Slurm job, else 29500); rank 0
//! serves it. The device is the launcher's local rank unless
//! `METRALE_COMM_DEVICE` names one.
//!
//! Invariants: reading never touches the process environment except in
//! [`Launch::from_env`] (tests pass a lookup); an empty variable counts as
//! unset; every missing or contradictory value is one [`LaunchError`]
//! listing every launcher variable found. Slurm's variables are never
//! checked against another launcher's: a job step inherits them into
//! whatever it starts (mpirun, torchrun), where they describe the step.

use std::net::SocketAddr;

use super::nodelist;
use super::{RendezvousError, TOKEN_ENV};

/// The variable that overrides the device.
pub const DEVICE_ENV: &str = "METRALE_COMM_DEVICE";
/// The port used when no variable names one, outside a Slurm job.
pub const DEFAULT_PORT: u16 = 29500;

/// The launchers [`Launch`] recognises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// PyTorch's torchrun (elastic agent).
    Torchrun,
    /// `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` set by hand or a script.
    Env,
    /// A Kubeflow PyTorchJob (no `LOCAL_RANK`, one GPU per pod).
    Kubeflow,
    /// Open MPI's mpirun.
    OpenMpi,
    /// MPICH's or Intel MPI's hydra (`PMI_RANK`).
    Mpich,
    /// A PMIx launcher (`PMIX_RANK` only).
    Pmix,
    /// Slurm's srun.
    Slurm,
}

impl Launcher {
    /// The launcher's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Env => "environment",
            Launcher::Kubeflow => "kubeflow",
            Launcher::OpenMpi => "open mpi",
            Launcher::Mpich => "mpich/intel mpi",
            Launcher::Pmix => "pmix",
            Launcher::Slurm => "slurm",
        }
    }
}

/// Who serves the store at [`Launch::master_addr`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreRole {
    /// The launcher does (torchrun's agent): every rank is a client.
    Launcher,
    /// Rank 0 binds the port and serves; the others are clients.
    Rank0,
}

/// The variables looked at, by the launcher they belong to (for errors).
const KNOWN: &[(&str, &[&str])] = &[
    (
        "torchrun",
        &[
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_USE_AGENT_STORE",
            "GROUP_RANK",
            "LOCAL_WORLD_SIZE",
        ],
    ),
    (
        "environment",
        &[
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ],
    ),
    ("kubeflow", &["KUBERNETES_SERVICE_HOST"]),
    (
        "open mpi",
        &[
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ],
    ),
    (
        "mpich/intel mpi",
        &["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
    ),
    ("pmix", &["PMIX_RANK"]),
    (
        "slurm",
        &[
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_JOB_ID",
        ],
    ),
    ("metrale", &[DEVICE_ENV]),
];

/// A missing or contradictory launcher value, with everything found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchError {
    /// The launcher whose variables were read.
    pub launcher: &'static str,
    /// What is wrong.
    pub problem: String,
    /// Every launcher variable set, as `VAR=value (launcher)`.
    pub found: Vec<String>,
}

impl std::fmt::Display for LaunchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} (found: ", self.launcher, self.problem)?;
        if self.found.is_empty() {
            f.write_str("no launcher variable)")
        } else {
            write!(f, "{})", self.found.join(", "))
        }
    }
}

impl std::error::Error for LaunchError {}

/// What the launcher says about this process.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Launch {
    /// Who launched it.
    pub launcher: Launcher,
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// Its rank among the ranks of its machine, when the launcher says.
    pub local_rank: Option<usize>,
    /// The ranks of its machine, when the launcher says.
    pub local_world_size: Option<usize>,
    /// Its CUDA device.
    pub device: usize,
    /// The variable the device came from (or `"kubeflow: one GPU per pod"`).
    pub device_from: &'static str,
    /// The store's host.
    pub master_addr: String,
    /// The store's port.
    pub master_port: u16,
    /// Who serves the store.
    pub store: StoreRole,
    /// The prefix of every key this job writes.
    pub namespace: String,
    /// `METRALE_STORE_TOKEN`, when set.
    pub token: Option<String>,
}

impl std::fmt::Debug for Launch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("launcher", &self.launcher)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("device", &self.device)
            .field("device_from", &self.device_from)
            .field("master_addr", &self.master_addr)
            .field("master_port", &self.master_port)
            .field("store", &self.store)
            .field("namespace", &self.namespace)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// The lookup with empty values as unset, and the error builder.
struct Env<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
    launcher: &'static str,
}

impl Env<'_> {
    fn var(&self, name: &str) -> Option<String> {
        (self.get)(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    }

    fn has(&self, name: &str) -> bool {
        self.var(name).is_some()
    }

    fn fail(&self, problem: impl Into<String>) -> LaunchError {
        let mut found = Vec::new();
        for (owner, vars) in KNOWN {
            for v in *vars {
                if let Some(value) = self.var(v) {
                    found.push(format!("{v}={value} ({owner})"));
                }
            }
        }
        LaunchError {
            launcher: self.launcher,
            problem: problem.into(),
            found,
        }
    }

    fn num(&self, name: &str) -> Result<Option<usize>, LaunchError> {
        match self.var(name) {
            None => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|_| self.fail(format!("{name}={v:?} is not a non-negative integer"))),
        }
    }

    fn need(&self, name: &str) -> Result<usize, LaunchError> {
        self.num(name)?
            .ok_or_else(|| self.fail(format!("{name} is not set")))
    }

    fn port(&self, name: &str) -> Result<Option<u16>, LaunchError> {
        match self.var(name) {
            None => Ok(None),
            Some(v) => match v.parse::<u16>() {
                Ok(p) if p > 0 => Ok(Some(p)),
                _ => Err(self.fail(format!("{name}={v:?} is not a port (1-65535)"))),
            },
        }
    }

    /// `rank < world`, `local < local_world <= world` where known.
    fn check_ranks(
        &self,
        (rank_var, rank): (&str, usize),
        (world_var, world): (&str, usize),
        local: Option<(&str, usize)>,
        local_world: Option<(&str, usize)>,
    ) -> Result<(), LaunchError> {
        if world == 0 {
            return Err(self.fail(format!("{world_var} is 0")));
        }
        if rank >= world {
            return Err(self.fail(format!(
                "{rank_var}={rank} is not below {world_var}={world}"
            )));
        }
        if let Some((lw_var, lw)) = local_world
            && (lw == 0 || lw > world)
        {
            return Err(self.fail(format!(
                "{lw_var}={lw} is not within 1..={world_var}={world}"
            )));
        }
        if let Some((l_var, l)) = local {
            let (bound_var, bound) = local_world.unwrap_or((world_var, world));
            if l >= bound {
                return Err(self.fail(format!("{l_var}={l} is not below {bound_var}={bound}")));
            }
        }
        Ok(())
    }

    /// A value two launchers both give must agree.
    fn agree(&self, ours: (&str, usize), theirs: &str) -> Result<(), LaunchError> {
        match self.num(theirs)? {
            Some(v) if v != ours.1 => {
                Err(self.fail(format!("{}={} contradicts {theirs}={v}", ours.0, ours.1)))
            }
            _ => Ok(()),
        }
    }

    /// `MASTER_ADDR`, else Slurm's first node; `MASTER_PORT`, else the default.
    fn master(&self) -> Result<(String, u16), LaunchError> {
        let addr = match self.var("MASTER_ADDR") {
            Some(a) => a,
            None => {
                let (var, list) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"]
                    .iter()
                    .find_map(|v| self.var(v).map(|l| (*v, l)))
                    .ok_or_else(|| {
                        self.fail(
                            "no store address: set MASTER_ADDR to the host of rank 0 \
                             (outside Slurm nothing else names it)",
                        )
                    })?;
                nodelist::first_node(&list).map_err(|e| self.fail(format!("{var}: {e}")))?
            }
        };
        let port = match self.port("MASTER_PORT")? {
            Some(p) => p,
            None => match self.num("SLURM_JOB_ID")? {
                // The result is below 30500, so it fits.
                Some(job) => DEFAULT_PORT + (job % 1000) as u16,
                None => DEFAULT_PORT,
            },
        };
        Ok((addr, port))
    }
}

impl Launch {
    /// Reads the process environment.
    pub fn from_env() -> Result<Launch, RendezvousError> {
        Self::from_lookup(|v| std::env::var(v).ok())
    }

    /// Reads the variables through `get` (a map in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Launch, RendezvousError> {
        detect(&get).map_err(RendezvousError::from)
    }

    /// Resolves the store's address (the first address found).
    pub fn master_socket_addr(&self) -> Result<SocketAddr, RendezvousError> {
        super::resolve(&self.master_addr, self.master_port)
    }
}

/// The fields every launcher fills the same way.
struct Found {
    launcher: Launcher,
    rank: usize,
    world_size: usize,
    local: Option<(&'static str, usize)>,
    local_world_size: Option<usize>,
}

fn detect(get: &dyn Fn(&str) -> Option<String>) -> Result<Launch, LaunchError> {
    let probe = Env {
        get,
        launcher: "launcher detection",
    };
    let env = |launcher: Launcher| Env {
        get,
        launcher: launcher.name(),
    };
    if probe.has("TORCHELASTIC_RUN_ID") {
        return torchrun(&env(Launcher::Torchrun));
    }
    let found = if probe.has("RANK") || probe.has("WORLD_SIZE") {
        let kubeflow = !probe.has("LOCAL_RANK") && probe.has("KUBERNETES_SERVICE_HOST");
        let launcher = if kubeflow {
            Launcher::Kubeflow
        } else {
            Launcher::Env
        };
        explicit(&env(launcher), launcher)?
    } else if probe.has("OMPI_COMM_WORLD_RANK") {
        open_mpi(&env(Launcher::OpenMpi))?
    } else if probe.has("PMI_RANK") {
        pmi(&env(Launcher::Mpich), Launcher::Mpich)?
    } else if probe.has("PMIX_RANK") {
        pmi(&env(Launcher::Pmix), Launcher::Pmix)?
    } else if probe.has("SLURM_PROCID") {
        slurm(&env(Launcher::Slurm))?
    } else {
        return Err(probe.fail(
            "no launcher found: run under torchrun, srun, mpirun or a Kubeflow PyTorchJob, \
             or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
        ));
    };
    let e = env(found.launcher);
    let (master_addr, master_port) =
        if found.launcher == Launcher::Env || found.launcher == Launcher::Kubeflow {
            let addr = e
                .var("MASTER_ADDR")
                .ok_or_else(|| e.fail("MASTER_ADDR is not set"))?;
            let port = e
                .port("MASTER_PORT")?
                .ok_or_else(|| e.fail("MASTER_PORT is not set"))?;
            (addr, port)
        } else {
            e.master()?
        };
    finish(
        &e,
        found,
        master_addr,
        master_port,
        StoreRole::Rank0,
        "metrale/".to_owned(),
    )
}

fn finish(
    e: &Env<'_>,
    found: Found,
    master_addr: String,
    master_port: u16,
    store: StoreRole,
    namespace: String,
) -> Result<Launch, LaunchError> {
    let (device, device_from) = match e.num(DEVICE_ENV)? {
        Some(d) => (d, DEVICE_ENV),
        None => match found.local {
            Some((var, l)) => (l, var),
            None => {
                return Err(e.fail(format!(
                    "no local rank to pick the device from: set {DEVICE_ENV}"
                )));
            }
        },
    };
    Ok(Launch {
        launcher: found.launcher,
        rank: found.rank,
        world_size: found.world_size,
        local_rank: found.local.map(|(_, l)| l),
        local_world_size: found.local_world_size,
        device,
        device_from,
        master_addr,
        master_port,
        store,
        namespace,
        token: e.var(TOKEN_ENV),
    })
}

fn torchrun(e: &Env<'_>) -> Result<Launch, LaunchError> {
    let rank = e.need("RANK")?;
    let world = e.need("WORLD_SIZE")?;
    let local = e.need("LOCAL_RANK")?;
    let local_world = e.need("LOCAL_WORLD_SIZE")?;
    e.check_ranks(
        ("RANK", rank),
        ("WORLD_SIZE", world),
        Some(("LOCAL_RANK", local)),
        Some(("LOCAL_WORLD_SIZE", local_world)),
    )?;
    let addr = e
        .var("MASTER_ADDR")
        .ok_or_else(|| e.fail("MASTER_ADDR is not set"))?;
    let port = e
        .port("MASTER_PORT")?
        .ok_or_else(|| e.fail("MASTER_PORT is not set"))?;
    let restart = e.num("TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0);
    let run_id = e.var("TORCHELASTIC_RUN_ID").unwrap_or_default();
    // torchrun writes Python's `str(True)`.
    let agent = e
        .var("TORCHELASTIC_USE_AGENT_STORE")
        .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
    let found = Found {
        launcher: Launcher::Torchrun,
        rank,
        world_size: world,
        local: Some(("LOCAL_RANK", local)),
        local_world_size: Some(local_world),
    };
    let store = if agent {
        StoreRole::Launcher
    } else {
        StoreRole::Rank0
    };
    finish(
        e,
        found,
        addr,
        port,
        store,
        format!("metrale/{run_id}/attempt_{restart}/"),
    )
}

fn explicit(e: &Env<'_>, launcher: Launcher) -> Result<Found, LaunchError> {
    let rank = e.need("RANK")?;
    let world = e.need("WORLD_SIZE")?;
    let local = if launcher == Launcher::Kubeflow {
        ("kubeflow: one GPU per pod", 0)
    } else {
        match e.num("LOCAL_RANK")? {
            Some(l) => ("LOCAL_RANK", l),
            None => ("RANK (no LOCAL_RANK)", rank),
        }
    };
    let local_world = e.num("LOCAL_WORLD_SIZE")?;
    e.check_ranks(
        ("RANK", rank),
        ("WORLD_SIZE", world),
        Some(local),
        local_world.map(|w| ("LOCAL_WORLD_SIZE", w)),
    )?;
    for other in ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"] {
        e.agree(("RANK", rank), other)?;
    }
    for other in ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"] {
        e.agree(("WORLD_SIZE", world), other)?;
    }
    Ok(Found {
        launcher,
        rank,
        world_size: world,
        local: Some(local),
        local_world_size: local_world.or((launcher == Launcher::Kubeflow).then_some(1)),
    })
}

fn open_mpi(e: &Env<'_>) -> Result<Found, LaunchError> {
    let rank = e.need("OMPI_COMM_WORLD_RANK")?;
    let world = e.need("OMPI_COMM_WORLD_SIZE")?;
    let local = e.need("OMPI_COMM_WORLD_LOCAL_RANK")?;
    let local_world = e.num("OMPI_COMM_WORLD_LOCAL_SIZE")?;
    e.check_ranks(
        ("OMPI_COMM_WORLD_RANK", rank),
        ("OMPI_COMM_WORLD_SIZE", world),
        Some(("OMPI_COMM_WORLD_LOCAL_RANK", local)),
        local_world.map(|w| ("OMPI_COMM_WORLD_LOCAL_SIZE", w)),
    )?;
    e.agree(("OMPI_COMM_WORLD_RANK", rank), "PMIX_RANK")?;
    Ok(Found {
        launcher: Launcher::OpenMpi,
        rank,
        world_size: world,
        local: Some(("OMPI_COMM_WORLD_LOCAL_RANK", local)),
        local_world_size: local_world,
    })
}

fn pmi(e: &Env<'_>, launcher: Launcher) -> Result<Found, LaunchError> {
    let (rank_var, rank) = match e.num("PMI_RANK")? {
        Some(r) => {
            e.agree(("PMI_RANK", r), "PMIX_RANK")?;
            ("PMI_RANK", r)
        }
        None => ("PMIX_RANK", e.need("PMIX_RANK")?),
    };
    // Under srun (PMIx or PMI-2 plugins) Slurm's own values describe the
    // same tasks: SLURM_PROCID is this rank.
    let under_srun = e.num("SLURM_PROCID")? == Some(rank);
    let world = match (e.num("PMI_SIZE")?, under_srun) {
        (Some(w), _) => ("PMI_SIZE", w),
        (None, true) => ("SLURM_NTASKS", e.need("SLURM_NTASKS")?),
        (None, false) => {
            return Err(e.fail("PMI_SIZE is not set (and this is no srun task to ask)"));
        }
    };
    let local = match (e.num("MPI_LOCALRANKID")?, under_srun) {
        (Some(l), _) => Some(("MPI_LOCALRANKID", l)),
        (None, true) => e.num("SLURM_LOCALID")?.map(|l| ("SLURM_LOCALID", l)),
        (None, false) => None,
    };
    let local_world = e.num("MPI_LOCALNRANKS")?;
    e.check_ranks(
        (rank_var, rank),
        world,
        local,
        local_world.map(|w| ("MPI_LOCALNRANKS", w)),
    )?;
    Ok(Found {
        launcher,
        rank,
        world_size: world.1,
        local,
        local_world_size: local_world,
    })
}

fn slurm(e: &Env<'_>) -> Result<Found, LaunchError> {
    let rank = e.need("SLURM_PROCID")?;
    let world = e.need("SLURM_NTASKS")?;
    let local = e.need("SLURM_LOCALID")?;
    e.check_ranks(
        ("SLURM_PROCID", rank),
        ("SLURM_NTASKS", world),
        Some(("SLURM_LOCALID", local)),
        None,
    )?;
    Ok(Found {
        launcher: Launcher::Slurm,
        rank,
        world_size: world,
        local: Some(("SLURM_LOCALID", local)),
        local_world_size: None,
    })
}

/// The wildcard address of `master`'s family, on its port: where rank 0
/// binds so that every host reaches it, whatever `MASTER_ADDR` resolves to
/// on rank 0's own host (often a loopback address).
pub(crate) fn bind_addr(master: SocketAddr) -> SocketAddr {
    let ip: std::net::IpAddr = match master {
        SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    SocketAddr::new(ip, master.port())
}
