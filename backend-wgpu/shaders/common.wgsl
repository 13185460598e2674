// Shared by every kernel (prepended at load time): the linear index of this invocation for
// 1-D dispatches split over x and y (x holds at most 65535 workgroups of 64).
fn linear_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 64u;
}
