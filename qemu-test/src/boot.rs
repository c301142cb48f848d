//! From Multiboot to Rust: the header QEMU's loader reads, the 32-bit entry
//! that builds identity page tables and enters long mode, the AP trampoline
//! (real mode to long mode), and the interrupt entry stubs.

use core::arch::global_asm;

// The Multiboot v1 header. Flag bit 16 (a.out kludge) makes the loader use
// the address fields below instead of parsing the file as ELF (QEMU refuses
// 64-bit ELF images): it copies the file from `load_addr` to
// `load_end_addr`, zeroes up to `bss_end_addr`, and jumps to `entry_addr`
// in 32-bit protected mode with EBX pointing at the Multiboot information.
global_asm!(
    r#"
    .section .multiboot, "a"
    .align 4
mb_header:
    .long 0x1BADB002
    .long 0x00010000
    .long -(0x1BADB002 + 0x00010000)
    .long mb_header
    .long __image_start
    .long __load_end
    .long __bss_end
    .long _start32
"#,
    options(att_syntax)
);

// The boot CPU's way to long mode: identity-map the first 4 GiB with 2 MiB
// pages (RAM, the local APIC at 0xFEE00000, ACPI tables), enable PAE, long
// mode and paging, load a GDT with a 64-bit code segment, and call
// `kernel_main(multiboot_info)` on the boot stack.
global_asm!(
    r#"
    .section .text.boot, "ax"
    .code32
    .global _start32
_start32:
    cli
    cld
    mov $boot_stack_top, %esp
    mov %ebx, %edi

    mov $pdpt, %eax
    or $3, %eax
    mov %eax, pml4
    movl $0, pml4 + 4

    xor %ecx, %ecx
1:
    mov %ecx, %eax
    shl $12, %eax
    add $pds, %eax
    or $3, %eax
    mov %eax, pdpt(, %ecx, 8)
    movl $0, pdpt + 4(, %ecx, 8)
    inc %ecx
    cmp $4, %ecx
    jne 1b

    xor %ecx, %ecx
2:
    mov %ecx, %eax
    shl $21, %eax
    or $0x83, %eax
    mov %eax, pds(, %ecx, 8)
    movl $0, pds + 4(, %ecx, 8)
    inc %ecx
    cmp $2048, %ecx
    jne 2b

    mov %cr4, %eax
    or $(1 << 5), %eax
    mov %eax, %cr4
    mov $pml4, %eax
    mov %eax, %cr3
    mov $0xC0000080, %ecx
    rdmsr
    or $((1 << 8) | (1 << 11)), %eax
    wrmsr
    mov %cr0, %eax
    or $((1 << 31) | (1 << 16)), %eax
    mov %eax, %cr0
    lgdt gdt_ptr
    ljmp $0x08, $start64

    .code64
start64:
    mov $0x10, %ax
    mov %ax, %ds
    mov %ax, %es
    mov %ax, %ss
    mov %ax, %fs
    mov %ax, %gs
    mov $boot_stack_top, %rsp
    mov %edi, %edi
    call kernel_main
3:
    hlt
    jmp 3b

    .section .rodata
    .align 16
gdt:
    .quad 0
    .quad 0x00AF9A000000FFFF
    .quad 0x00CF92000000FFFF
    .quad 0x00CF9A000000FFFF
gdt_end:
    .global gdt_ptr
gdt_ptr:
    .word gdt_end - gdt - 1
    .quad gdt

    .section .bss, "aw", @nobits
    .align 4096
    .global pml4, pdpt
pml4:
    .skip 4096
pdpt:
    .skip 4096
pds:
    .skip 4096 * 4
boot_stack:
    .skip 65536
boot_stack_top:
"#,
    options(att_syntax)
);

// The application processors' trampoline. It is copied to physical 0x8000
// (the STARTUP IPI's page 8) and runs there, so every address in it is
// computed as `label - ap_tramp_start + 0x8000`. The boot CPU patches the
// page-table root, the stack top and the CPU index into the copy.
global_asm!(
    r#"
    .section .rodata.trampoline, "a"
    .global ap_tramp_start, ap_tramp_end, tramp_cr3, tramp_stack, tramp_cpu
    .code16
ap_tramp_start:
    cli
    cld
    xor %ax, %ax
    mov %ax, %ds
    lgdtl (tramp_gdt_ptr - ap_tramp_start + 0x8000)
    mov %cr0, %eax
    or $1, %eax
    mov %eax, %cr0
    ljmpl $0x18, $(tramp32 - ap_tramp_start + 0x8000)

    .code32
tramp32:
    mov $0x10, %ax
    mov %ax, %ds
    mov %ax, %es
    mov %ax, %ss
    mov %cr4, %eax
    or $(1 << 5), %eax
    mov %eax, %cr4
    mov (tramp_cr3 - ap_tramp_start + 0x8000), %eax
    mov %eax, %cr3
    mov $0xC0000080, %ecx
    rdmsr
    or $((1 << 8) | (1 << 11)), %eax
    wrmsr
    mov %cr0, %eax
    or $((1 << 31) | (1 << 16)), %eax
    mov %eax, %cr0
    ljmp $0x08, $(tramp64 - ap_tramp_start + 0x8000)

    .code64
tramp64:
    mov $0x10, %ax
    mov %ax, %ds
    mov %ax, %es
    mov %ax, %ss
    mov %ax, %fs
    mov %ax, %gs
    mov (tramp_stack - ap_tramp_start + 0x8000), %rsp
    mov (tramp_cpu - ap_tramp_start + 0x8000), %edi
    movabs $ap_main, %rax
    call *%rax
4:
    hlt
    jmp 4b

    .align 16
tramp_gdt:
    .quad 0
    .quad 0x00AF9A000000FFFF
    .quad 0x00CF92000000FFFF
    .quad 0x00CF9A000000FFFF
tramp_gdt_ptr:
    .word 31
    .long tramp_gdt - ap_tramp_start + 0x8000
    .align 8
tramp_cr3:
    .quad 0
tramp_stack:
    .quad 0
tramp_cpu:
    .quad 0
ap_tramp_end:
"#,
    options(att_syntax)
);

// Interrupt entry: every stub pushes an error code (a zero where the CPU
// pushes none) and its vector, then the common path saves the general
// registers and calls `interrupt_dispatch(&mut Frame)`.
global_asm!(
    r#"
    .section .text
    .irp n, 0,1,2,3,4,5,6,7,9,15,16,18,19,20,22,23,24,25,26,27,28,31,240,255
isr_\n:
    push $0
    push $\n
    jmp isr_common
    .endr
    .irp n, 8,10,11,12,13,14,17,21,29,30
isr_\n:
    push $\n
    jmp isr_common
    .endr

isr_common:
    push %rax
    push %rcx
    push %rdx
    push %rbx
    push %rbp
    push %rsi
    push %rdi
    push %r8
    push %r9
    push %r10
    push %r11
    push %r12
    push %r13
    push %r14
    push %r15
    mov %rsp, %rdi
    call interrupt_dispatch
    pop %r15
    pop %r14
    pop %r13
    pop %r12
    pop %r11
    pop %r10
    pop %r9
    pop %r8
    pop %rdi
    pop %rsi
    pop %rbp
    pop %rbx
    pop %rdx
    pop %rcx
    pop %rax
    add $16, %rsp
    iretq

    .section .rodata
    .align 8
    .global isr_table
isr_table:
    .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,240,255
    .quad isr_\n
    .endr
"#,
    options(att_syntax)
);

/// The registers an interrupt stub saved, in stack order.
#[repr(C)]
pub struct Frame {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rdi: u64,
    pub rsi: u64,
    pub rbp: u64,
    pub rbx: u64,
    pub rdx: u64,
    pub rcx: u64,
    pub rax: u64,
    pub vector: u64,
    pub error: u64,
    pub rip: u64,
    pub cs: u64,
    pub rflags: u64,
    pub rsp: u64,
    pub ss: u64,
}

extern "C" {
    pub static isr_table: [u64; 34];
    pub static ap_tramp_start: u8;
    pub static ap_tramp_end: u8;
    pub static tramp_cr3: u64;
    pub static tramp_stack: u64;
    pub static tramp_cpu: u64;
    pub static pml4: u8;
    pub static __bss_end: u8;
    pub static pdpt: u8;
}
