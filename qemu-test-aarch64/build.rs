//! Links the kernel with its own script: one load address in the virt
//! machine's RAM, far enough above RAM's base for the DTB QEMU puts there.

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    println!("cargo:rustc-link-arg=-T{dir}/linker.ld");
    println!("cargo:rerun-if-changed=linker.ld");
}
