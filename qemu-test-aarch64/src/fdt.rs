//! A small reader of the flattened device tree QEMU hands the kernel: the
//! few properties this kernel needs (how to call PSCI, the CPUs, RAM, the
//! command line), nothing more.
//!
//! QEMU's virt machine builds the DTB itself. For an ELF `-kernel` (not a
//! Linux image) it writes it at the start of RAM when the image leaves
//! room there, and puts `-append`'s text in `/chosen/bootargs`.

/// What the kernel takes from the DTB.
pub struct BootInfo<'a> {
    /// `/psci`'s `method`: `hvc` or `smc`.
    pub psci_method: &'a [u8],
    /// `/chosen/bootargs`, empty if absent.
    pub bootargs: &'a [u8],
    /// The first `/memory` node's first range.
    pub ram: (u64, u64),
    /// The MPIDR affinity value (`reg`) of each `/cpus/cpu@...` node, in
    /// tree order, and how many there are (at most [`crate::MAX_CPUS`] kept).
    pub cpus: [u64; crate::MAX_CPUS],
    pub cpu_count: usize,
    /// CPU nodes listed beyond the ones kept.
    pub cpus_dropped: usize,
}

const MAGIC: u32 = 0xd00d_feed;
const BEGIN_NODE: u32 = 1;
const END_NODE: u32 = 2;
const PROP: u32 = 3;
const NOP: u32 = 4;
const END: u32 = 9;
const MAX_DEPTH: usize = 8;

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn be_cells(v: &[u8]) -> Option<u64> {
    match v.len() {
        4 => Some(u64::from(be32(v, 0)?)),
        8 => Some(u64::from(be32(v, 0)?) << 32 | u64::from(be32(v, 4)?)),
        _ => None,
    }
}

/// A NUL-terminated string property, without its NUL.
fn string(v: &[u8]) -> &[u8] {
    v.split(|&b| b == 0).next().unwrap_or(&[])
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Reads the DTB at `addr`.
///
/// # Safety
///
/// `addr` must be readable memory that holds a DTB or at least 8 bytes
/// (the header's magic and size are checked before the rest is read), and
/// it must stay unchanged while the result lives.
pub unsafe fn read(addr: u64) -> Result<BootInfo<'static>, &'static str> {
    // SAFETY: the caller vouches for 8 readable bytes at `addr`.
    let head = unsafe { core::slice::from_raw_parts(addr as *const u8, 8) };
    if be32(head, 0) != Some(MAGIC) {
        return Err("no DTB (bad magic)");
    }
    let total = be32(head, 4).unwrap_or(0) as usize;
    if !(40..=(16 << 20)).contains(&total) {
        return Err("DTB size out of range");
    }
    // SAFETY: the header says the blob is `total` bytes long; the caller
    // vouches for the blob.
    let blob = unsafe { core::slice::from_raw_parts(addr as *const u8, total) };
    parse(blob).ok_or("malformed DTB")
}

fn parse(blob: &'static [u8]) -> Option<BootInfo<'static>> {
    let structs = be32(blob, 8)? as usize;
    let strings = be32(blob, 12)? as usize;
    let mut info = BootInfo {
        psci_method: &[],
        bootargs: &[],
        ram: (0, 0),
        cpus: [0; crate::MAX_CPUS],
        cpu_count: 0,
        cpus_dropped: 0,
    };
    // The names of the nodes from the root down to the current one (the
    // root's own name is empty and not kept).
    let mut path: [&[u8]; MAX_DEPTH] = [&[]; MAX_DEPTH];
    let mut depth = 0usize;
    let mut at = structs;
    loop {
        let token = be32(blob, at)?;
        at += 4;
        match token {
            BEGIN_NODE => {
                let name = string(blob.get(at..)?);
                at = align4(at + name.len() + 1);
                if depth > 0 {
                    *path.get_mut(depth - 1)? = name;
                }
                depth += 1;
            }
            END_NODE => depth = depth.checked_sub(1)?,
            PROP => {
                let len = be32(blob, at)? as usize;
                let name = string(blob.get(strings + be32(blob, at + 4)? as usize..)?);
                let value = blob.get(at + 8..at + 8 + len)?;
                at = align4(at + 8 + len);
                take(&mut info, path.get(..depth.saturating_sub(1))?, name, value);
            }
            NOP => {}
            END => return Some(info),
            _ => return None,
        }
    }
}

fn take(info: &mut BootInfo<'static>, path: &[&[u8]], name: &[u8], value: &'static [u8]) {
    match (path, name) {
        ([b"psci"], b"method") => info.psci_method = string(value),
        ([b"chosen"], b"bootargs") => info.bootargs = string(value),
        ([node], b"reg") if node.starts_with(b"memory") && info.ram.1 == 0 => {
            // The root's #address-cells and #size-cells are 2 on virt.
            if let (Some(base), Some(size)) = (value.get(..8), value.get(8..16)) {
                info.ram = (be_cells(base).unwrap_or(0), be_cells(size).unwrap_or(0));
            }
        }
        ([b"cpus", node], b"reg") if node.starts_with(b"cpu@") => match be_cells(value) {
            Some(mpidr) if info.cpu_count < crate::MAX_CPUS => {
                info.cpus[info.cpu_count] = mpidr;
                info.cpu_count += 1;
            }
            _ => info.cpus_dropped += 1,
        },
        _ => {}
    }
}
