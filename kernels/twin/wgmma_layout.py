"""The shared-memory arithmetic the wgmma kernels' layout twins share: common.cuh's
`swizzled` tile offsets, wgmma.cuh's `wg_desc` descriptors, and the PTX ISA's
canonical K-major and MN-major layouts with the 128-byte swizzle, through which an
operand element's byte address is read back from a descriptor."""


def swizzled(r, c):
    """common.cuh swizzled: byte offset of 16-byte chunk c of row r in a 128-byte-row tile."""
    return r * 128 + ((c ^ (r & 7)) << 4)


def swizzle128(addr):
    """Swizzle<3,4,3>: byte-address bits 4-6 XOR bits 7-9."""
    return addr ^ (((addr >> 7) & 7) << 4)


def desc(addr, lbo, sbo):
    """wgmma.cuh wg_desc: start address, leading and stride byte offsets in 16-byte units, 128B swizzle."""
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62)


def decode(d):
    assert d >> 62 == 1, "not the 128-byte swizzle"
    assert (d >> 49) & 7 == 0, "base offset set"
    return (d & 0x3FFF) << 4, ((d >> 16) & 0x3FFF) << 4, ((d >> 32) & 0x3FFF) << 4


def read_kmajor(d, row, kk):
    """Byte address of element (row, kk) of a K-major operand: ((8,m),(T,2k)):((8T,SBO),(1,T))."""
    start, _lbo, sbo = decode(d)
    return swizzle128(start + (row % 8) * 128 + (row // 8) * sbo + kk * 2)


def read_mnmajor(d, kk, n):
    """Byte address of element (kk, n) of an MN-major operand: ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))."""
    start, lbo, sbo = decode(d)
    return swizzle128(start + (n % 8) * 2 + ((n // 8) % 8) * 16 + (n // 64) * lbo + (kk % 8) * 128 + (kk // 8) * sbo)
