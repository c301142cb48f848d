//! PSCI calls, to start the secondary CPUs.
//!
//! QEMU's virt machine without EL2/EL3 firmware implements PSCI itself and
//! says so in the DTB: `/psci` has `method = "hvc"` (SMC when the guest
//! has EL2 itself, with `virtualization=on`). The conduit is read from the
//! DTB, not assumed.

/// How PSCI is called.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Conduit {
    Hvc,
    Smc,
}

impl Conduit {
    pub fn from_method(method: &[u8]) -> Option<Self> {
        match method {
            b"hvc" => Some(Conduit::Hvc),
            b"smc" => Some(Conduit::Smc),
            _ => None,
        }
    }
}

const PSCI_VERSION: u32 = 0x8400_0000;
/// The SMC64 function id: 64-bit entry point and context id.
const CPU_ON_64: u32 = 0xc400_0003;

fn call(conduit: Conduit, function: u32, a1: u64, a2: u64, a3: u64) -> i64 {
    let mut x0 = u64::from(function);
    // SAFETY: an SMC Calling Convention call: function id in w0, arguments
    // in x1-x3, result in x0; x1-x17 may be clobbered by the callee, which
    // touches no memory of ours.
    unsafe {
        match conduit {
            Conduit::Hvc => core::arch::asm!(
                "hvc #0",
                inout("x0") x0,
                inout("x1") a1 => _, inout("x2") a2 => _, inout("x3") a3 => _,
                out("x4") _, out("x5") _, out("x6") _, out("x7") _,
                out("x8") _, out("x9") _, out("x10") _, out("x11") _,
                out("x12") _, out("x13") _, out("x14") _, out("x15") _,
                out("x16") _, out("x17") _,
                options(nostack),
            ),
            Conduit::Smc => core::arch::asm!(
                "smc #0",
                inout("x0") x0,
                inout("x1") a1 => _, inout("x2") a2 => _, inout("x3") a3 => _,
                out("x4") _, out("x5") _, out("x6") _, out("x7") _,
                out("x8") _, out("x9") _, out("x10") _, out("x11") _,
                out("x12") _, out("x13") _, out("x14") _, out("x15") _,
                out("x16") _, out("x17") _,
                options(nostack),
            ),
        }
    }
    x0 as i64
}

/// PSCI's version as (major, minor).
pub fn version(conduit: Conduit) -> (u32, u32) {
    let v = call(conduit, PSCI_VERSION, 0, 0, 0) as u32;
    (v >> 16, v & 0xffff)
}

/// Starts the CPU whose MPIDR affinity is `mpidr` at physical address
/// `entry`, at this CPU's exception level with its MMU off, with
/// `context` in x0. Returns PSCI's status (0 on success, negative on
/// error: -2 invalid parameters, -4 already on, -5 on pending).
pub fn cpu_on(conduit: Conduit, mpidr: u64, entry: u64, context: u64) -> i64 {
    call(conduit, CPU_ON_64, mpidr, entry, context)
}
