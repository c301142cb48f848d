//! Just enough ACPI to find the CPUs: the RSDP, the RSDT or XSDT, and the
//! MADT's local APIC and x2APIC entries (identity-mapped low memory).

/// The enabled CPUs' APIC IDs, boot CPU included.
pub struct Cpus {
    pub ids: [u32; 64],
    pub count: usize,
    /// Every enabled processor the MADT lists, including those past `ids`.
    pub listed: usize,
}

unsafe fn read<T: Copy>(addr: u64) -> T {
    // SAFETY: the caller passes an address inside identity-mapped firmware
    // tables; unaligned reads are allowed.
    unsafe { core::ptr::read_unaligned(addr as *const T) }
}

fn find_rsdp() -> Option<u64> {
    // The BIOS area 0xE0000-0xFFFFF, on 16-byte boundaries.
    (0xe0000u64..0x100000).step_by(16).find(|&a| {
        // SAFETY: the BIOS area is identity-mapped RAM/ROM.
        unsafe { read::<[u8; 8]>(a) == *b"RSD PTR " }
    })
}

fn find_table(signature: &[u8; 4]) -> Option<u64> {
    let rsdp = find_rsdp()?;
    // SAFETY: RSDP fields at their ACPI-defined offsets.
    let (revision, rsdt, xsdt) = unsafe {
        (
            read::<u8>(rsdp + 15),
            read::<u32>(rsdp + 16),
            read::<u64>(rsdp + 24),
        )
    };
    let (root, entry_size) = if revision >= 2 && xsdt != 0 {
        (xsdt, 8)
    } else {
        (u64::from(rsdt), 4)
    };
    // SAFETY: the root table header's length field.
    let length = unsafe { read::<u32>(root + 4) } as u64;
    let mut entry = root + 36;
    while entry + entry_size <= root + length {
        // SAFETY: entries of the root table, then each table's signature.
        let table = unsafe {
            if entry_size == 8 {
                read::<u64>(entry)
            } else {
                u64::from(read::<u32>(entry))
            }
        };
        // SAFETY: as above.
        if unsafe { read::<[u8; 4]>(table) } == *signature {
            return Some(table);
        }
        entry += entry_size;
    }
    None
}

/// The enabled processors listed in the MADT.
pub fn cpus() -> Option<Cpus> {
    let madt = find_table(b"APIC")?;
    let mut out = Cpus {
        ids: [0; 64],
        count: 0,
        listed: 0,
    };
    // SAFETY: the MADT header's length field.
    let length = unsafe { read::<u32>(madt + 4) } as u64;
    let mut p = madt + 44;
    while p + 2 <= madt + length {
        // SAFETY: MADT entries: type, length, then type-specific fields.
        let (kind, len) = unsafe { (read::<u8>(p), read::<u8>(p + 1)) };
        if len < 2 {
            break;
        }
        // SAFETY: fields of a local APIC (type 0) or x2APIC (type 9) entry.
        let cpu = unsafe {
            match kind {
                0 if read::<u32>(p + 4) & 1 != 0 => Some(u32::from(read::<u8>(p + 3))),
                9 if read::<u32>(p + 8) & 1 != 0 => Some(read::<u32>(p + 4)),
                _ => None,
            }
        };
        if let Some(id) = cpu {
            if !out.ids[..out.count].contains(&id) {
                out.listed += 1;
                if out.count < out.ids.len() {
                    out.ids[out.count] = id;
                    out.count += 1;
                }
            }
        }
        p += u64::from(len);
    }
    Some(out)
}
