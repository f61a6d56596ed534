//! Prints the path of the bare-metal test guest ELF that `build.rs` built, so scripts (the
//! demo) can boot it without repeating the guest's build recipe.

fn main() {
    println!("{}", lendvm_tests::TEST_GUEST);
}
