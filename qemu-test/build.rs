//! Links the kernel with its own script (load address, Multiboot header
//! first, file layout equal to memory layout).

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    println!("cargo:rustc-link-arg=-T{dir}/linker.ld");
    println!("cargo:rustc-link-arg=--no-pie");
    println!("cargo:rerun-if-changed=linker.ld");
}
