#include <cstdio>
int main() { std::puts("moesrv"); return 0; }
